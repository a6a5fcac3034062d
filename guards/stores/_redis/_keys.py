"""The store's keys in Redis (`Keys`). `<prefix>` is the store's; `{<key>}` is a Redis Cluster
hash tag holding the guard's key, with `%`, `{` and `}` percent-escaped (`tag`), so every key of
one budget, or of one model, lives in one slot:

- `<prefix>{<key>}:window`: hash of the sliding minute's admissions (see the script's `charge`),
  kept 60 s after the last admission;
- `<prefix>{<key>}:day:YYYY-MM-DD`: the day's admission counter, kept `DAILY_TTL_S` from its
  first unit;
- `<prefix>{<key>}:spend:YYYY-MM-DD`: hash of the day's spend: field `settled` (the settled
  total) and one field `h:<reservation>` = `"<amount> <expires_at>"` per hold, kept
  `DAILY_TTL_S` from the last hold;
- `<prefix>{<key>}:share:<minute>`: a shared limit's UTC minute (`guards.stores._share`), a
  hash of its active tenants, and `...:h`, its token holds awaiting settlement; both kept two
  minutes (the minute is `floor(now / 60)` of the store's clock);
- `<prefix>{<key>}:breaker`: the breaker state (one string), kept `Breaker.ttl_s` after its
  last write; a closed breaker without failures (and no calls counted: `Breaker.slow_call_s`)
  has no key;
- `<prefix>{<key>}:cooldown`: the time a cooldown ends (store time, `%.17g`), kept until then
  (set with `PX` in the script that writes it); no key while not cooling down;
- `<prefix>{<key>}:answer`: a route's last good answer (its key a hash): `"<stored_at>
  <expires_at> <value>"`, kept `ttl_s` (`PX`).
- `<prefix>{<key>}:task`: a multi-step task, one hash: `fp` (its fingerprint), `lease` (empty
  while nobody holds it), `until` (the lease's end), `exp` (the task's expiry, store time),
  `own` (its owner's key, or empty), `response` once it completed, and `s:<name>` per saved
  step; kept `ttl_s` from its creation.
- `<prefix>epoch`: the store's epoch marker (see `guards.stores._epoch`), the one key without a
  TTL: read (and made again when missing) by every `step` and `task_claim`, whose KEYS end with
  it. It has no hash tag: its own slot. On Redis Cluster, one per hash slot used instead,
  `<prefix>{<slot's tag>}:epoch` (`Keys.marker`), read by each script of a step in that slot.
- `<prefix>{<owner>}:tasks`: an owner's live tasks, a sorted set of task keys scored by their
  expiry (store time), kept until the last of them expires. (Dropping a task removes it from
  its owner's set, whose key the task's hash names: a key the script is not given, in
  another slot on Redis Cluster.)

On Redis Cluster a model's breaker and cooldown (the walk's `guards:breaker:<model>` and
`guards:cooldown:<model>`) share the tag `m:<model>`, each key then spelt whole after it
(`Keys.key`): a model's keys in one slot. Cooldowns of different keys live in different slots
(each its own hash tag, like every other key).
"""

from __future__ import annotations

from .._base import bounded_key
from .._cluster import slot_tag

__all__ = ["Keys", "tag"]

#: The walk's per-model keys (`guards:breaker:<model>`, `guards:cooldown:<model>`): on Redis
#: Cluster both in the model's slot (`Keys.key`).
_MODEL_KEYS = ("guards:breaker:", "guards:cooldown:")


class Keys:
    """The names of a store's keys: `prefix` starts each (no `{` or `}` in it: the store
    checks), `cluster` says whether the store is on Redis Cluster."""

    __slots__ = ("cluster", "epoch", "prefix")

    def __init__(self, prefix: str, cluster: bool) -> None:
        self.prefix = prefix
        self.cluster = cluster
        #: The store's epoch marker (see `guards.stores._epoch`): outside every hash tag.
        self.epoch = f"{prefix}epoch"

    def key(self, key: str) -> str:
        """The stem of `key`'s keys: the prefix and its hash tag (a suffix names each key)."""
        key = bounded_key(key)
        if self.cluster and key.startswith(_MODEL_KEYS):
            # Redis Cluster: a model's breaker and cooldown in one slot, the model's (the whole
            # key after the tag keeps every key distinct).
            return f"{self.prefix}{{{tag('m:' + key.partition(':')[2].partition(':')[2])}}}{tag(key)}"
        return f"{self.prefix}{{{tag(key)}}}"

    def marker(self, slot: int) -> str:
        """Redis Cluster: the epoch marker of `slot`, read by the scripts of a step in it."""
        return f"{self.prefix}{{{slot_tag(slot)}}}:epoch"


def tag(key: str) -> str:
    """`key` as a hash tag's content: `{`, `}` and `%` percent-escaped, so the tag is the whole
    key (one slot per key, spread over the cluster) and distinct keys stay distinct. The empty
    key becomes `%`, which no escaped key can be (an empty tag would not be a tag)."""
    return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D") or "%"
