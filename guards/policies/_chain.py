"""Fallback chains: which models a route may call, in order, and where each one is served.

A chain entry is a string, or a `Model`: a string with call limits of its own
(`first_output_s`, `stream_idle_s`, `min_chars_per_s`), which every model the string names gets
unless it has its own (a `Profile` whose `model` is a `Model`); a route's own limits fill in what
is still unset.
The string is:

- `"provider:model"`, when `provider` names a binding given to `Guards(providers=...)` (or
  `"default"`, the main binding): that model at that provider;
- `"hint:name"`, when `name` is a routing hint given to `Guards(hints=...)`: the hint's target
  (itself a model spec or a profile name), resolved here, before the target's own reliability
  policy (breaker, cooldown, retries) applies; each model it yields remembers the hint
  (`ModelRef.hint`). An unknown hint is reported and kept as the literal main-binding model id
  `hint:name`, which the provider may reject (the usual classification follows);
- the name of a `Profile`: the profile's model, then its fallbacks, depth-first;
- anything else: a model id of the main binding (`"@cf/meta/llama-3.1-8b-instruct"`).

A `Deployments` (a `Model` too) is a group of deployments of one model: one model of the chain
per deployment, in the order declared, keyed `group/name` (the walk orders them per request:
`guards.policies._deployments`).

Chains are flattened once, at start-up. Dangling references, cycles, excessive depth, empty model
ids and duplicates are reported and removed; a provider prefix that names no configured provider
fails start-up instead (`ConfigurationError`): its credentials are missing, and quietly calling
another provider would change the route.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Literal, get_args

from ..contracts._errors import ConfigurationError
from ..contracts._settings import number, settings

__all__ = [
    "DEFAULT_PROVIDER",
    "HINT_PREFIX",
    "MAX_PROFILE_DEPTH",
    "MAX_DEPLOYMENTS",
    "Chain",
    "Deployment",
    "Deployments",
    "Limits",
    "Model",
    "ModelRef",
    "Profile",
    "Strategy",
    "check_hints",
    "check_limit",
    "check_rate",
    "entry_parts",
    "flatten_chain",
    "group_models",
]

#: The provider name of the binding given to `Guards(binding)`.
DEFAULT_PROVIDER = "default"
#: Profiles nested deeper than this are cut off (and reported).
MAX_PROFILE_DEPTH = 8
#: A chain entry starting with this names a routing hint (`hint:fast`).
HINT_PREFIX = "hint:"
_PROVIDER = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
Strategy = Literal["weighted", "least_busy", "lowest_latency"]
_STRATEGIES: tuple[str, ...] = get_args(Strategy)
#: The most deployments a group may have.
MAX_DEPLOYMENTS = 16
#: A deployment's and a group's name: a metric label value's part (short, printable, no `/`).
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
#: What a hint's name may be (it is a metric label value: short, printable, no spaces).
_HINT_NAME = _PROVIDER


@dataclass(frozen=True, slots=True)
class ModelRef:
    """One model of a chain: `model` at `provider` (None: the main binding). `hint` is the
    routing hint the chain entry named, when the model came from one; `first_output_s`,
    `stream_idle_s` and `min_chars_per_s` its call limits (see `Model`; None: none). None of
    these is part of equality: the model is the same whichever way it was named."""

    provider: str | None
    model: str
    hint: str | None = field(default=None, compare=False)
    first_output_s: float | None = field(default=None, compare=False, kw_only=True)
    stream_idle_s: float | None = field(default=None, compare=False, kw_only=True)
    min_chars_per_s: float | None = field(default=None, compare=False, kw_only=True)
    #: The deployment this model is, and its group (`Deployments`), when it came from one.
    deployment: Deployment | None = field(default=None, kw_only=True)
    group: Deployments | None = field(default=None, compare=False, kw_only=True)
    #: How the model is named in keys, logs and headers: `model` or `provider:model`, a
    #: deployment's `group/name` (made once: read on every request's path).
    key: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.deployment is not None and self.group is not None:
            key = self.group.key(self.deployment)
        else:
            key = self.model if self.provider is None else f"{self.provider}:{self.model}"
        object.__setattr__(self, "key", key)

    @property
    def entry(self) -> str:
        """The chain entry as written: `hint:name` for a model a hint resolved to, else `key`."""
        return self.key if self.hint is None else HINT_PREFIX + self.hint

    def limited(self, limits: Limits) -> ModelRef:
        """This model with `limits` where it has none of its own."""
        own = (self.first_output_s, self.stream_idle_s, self.min_chars_per_s)
        first_output_s, stream_idle_s, min_chars_per_s = merged = _inner(own, limits)
        if merged == own:
            return self
        return replace(
            self, first_output_s=first_output_s, stream_idle_s=stream_idle_s, min_chars_per_s=min_chars_per_s
        )


#: `(first_output_s, stream_idle_s, min_chars_per_s)`: a model's call limits, None where unset.
Limits = tuple[float | None, float | None, float | None]
_NO_LIMITS: Limits = (None, None, None)


def check_limit(name: str, value: float | None) -> float | None:
    """`value` as a call limit: None, or a positive finite number of seconds; raises
    `ConfigurationError` naming `name` otherwise."""
    number(name, value, above=0, unit="seconds", none="no limit")
    return None if value is None else float(value)


def check_rate(name: str, value: float | None) -> float | None:
    """`value` as a minimum rate: None, or a positive finite number of characters per second;
    raises `ConfigurationError` naming `name` otherwise."""
    number(name, value, above=0, unit="characters per second", none="no minimum")
    return None if value is None else float(value)


@settings
@dataclass(frozen=True, slots=True)
class Model:
    """A chain entry with call limits of its own, accepted wherever a chain entry string is
    (`route(model=...)`, `route(fallbacks=[...])`, `Profile(model=...)`).

    `spec` is the entry as a string would say it (a model id, `"provider:model"`,
    `"hint:name"` or a profile name). `first_output_s`: how long one attempt on the model may
    take to produce its first output (a stream's first output part; a whole answer's first
    byte, when its binding says when that came, else the whole answer); past it the attempt
    is cancelled and fails as `model_temporarily_unavailable`. `stream_idle_s`: once a stream
    has sent output, the longest wait for its next part; past it the stream ends with its
    `error` event. `min_chars_per_s`: the slowest a stream may be before its commit point,
    in characters of output per second, measured over the route's hold or the first second
    after its first output (see docs/streaming.md, "Minimum throughput"); a model below it is
    cancelled before the commit and the walk moves on, as for `first_output_s`. None (the
    default): no limit of the model's own (the route's, if any). A plain string is the same as
    `Model(spec)`. Raises `ConfigurationError` for a limit that is not a positive, finite
    number.
    """

    spec: str
    _: KW_ONLY
    first_output_s: float | None = None
    stream_idle_s: float | None = None
    min_chars_per_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.spec, str):
            raise ConfigurationError(f"Model(spec): a chain entry string, not {type(self.spec).__name__}")
        object.__setattr__(self, "first_output_s", check_limit("Model.first_output_s", self.first_output_s))
        object.__setattr__(self, "stream_idle_s", check_limit("Model.stream_idle_s", self.stream_idle_s))
        object.__setattr__(self, "min_chars_per_s", check_rate("Model.min_chars_per_s", self.min_chars_per_s))

    @property
    def limits(self) -> Limits:
        return self.first_output_s, self.stream_idle_s, self.min_chars_per_s


def entry_parts(entry: str | Model) -> tuple[str, Limits]:
    """A chain entry's string and its own limits."""
    if isinstance(entry, Model):
        return entry.spec, entry.limits
    return entry, _NO_LIMITS


def _inner(limits: Limits, outer: Limits) -> Limits:
    """`limits`, with `outer`'s where it has none."""
    return (
        limits[0] if limits[0] is not None else outer[0],
        limits[1] if limits[1] is not None else outer[1],
        limits[2] if limits[2] is not None else outer[2],
    )


def _positive_int(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"{name} must be a whole number of at least 1, or None (no limit); got {value!r}"
        )
    return value


@settings
@dataclass(frozen=True, slots=True)
class Deployment:
    """One deployment of a model: `model` (its id at that provider) served by `provider` (a
    provider name of `Guards(providers=...)`, or `"default"`: so its own credentials, region or
    endpoint). `weight`: its share under the `"weighted"` strategy (a positive number). `rpm`,
    `tpm`: its own limits, requests and tokens per sliding minute, enforced exactly through the
    store across workers; a deployment at one is skipped (as an open breaker is), not failed.
    None: no limit. Raises `ConfigurationError` for a name that is not a short token, or a
    weight or limit out of range."""

    name: str
    _: KW_ONLY
    provider: str
    model: str
    weight: float = 1.0
    rpm: int | None = None
    tpm: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigurationError(
                f"Deployment name {self.name!r}: a letter, then up to 63 letters, digits, '_', '.' or '-'"
            )
        if not isinstance(self.provider, str) or not self.provider.strip():
            raise ConfigurationError(
                f"Deployment {self.name!r}: provider names a binding of Guards(providers=...)"
            )
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigurationError(f"Deployment {self.name!r}: model is the model's id at its provider")
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise ConfigurationError(
                f"Deployment {self.name!r}: weight must be a positive number; got {weight!r}"
            )
        object.__setattr__(self, "weight", float(weight))
        object.__setattr__(self, "rpm", _positive_int(f"Deployment {self.name!r}: rpm", self.rpm))
        object.__setattr__(self, "tpm", _positive_int(f"Deployment {self.name!r}: tpm", self.tpm))

    @property
    def limited(self) -> bool:
        """Whether a call to it takes a store step of its own (`rpm` or `tpm` set)."""
        return self.rpm is not None or self.tpm is not None


@settings
@dataclass(frozen=True, slots=True)
class Deployments(Model):
    """A chain entry that is a group of deployments of one model, named `spec` (the group's
    name: a short token), accepted wherever a chain entry is (`route(model=...)`,
    `route(fallbacks=[...])`, `Profile(model=...)`), with a `Model`'s call limits for each of
    its deployments. `strategy` chooses the deployment a call goes to first (see the module's
    docstring: `"weighted"`, `"least_busy"`, `"lowest_latency"`). Each deployment is a model of
    the chain keyed `spec/name`; a call that fails moves to another deployment of the group, and
    the chain moves on to its next entry when each was skipped or failed. Raises
    `ConfigurationError` for no deployment, more than `MAX_DEPLOYMENTS`, a name given twice, or
    an unknown strategy."""

    deployments: Sequence[Deployment]
    strategy: Strategy = field(default="weighted", kw_only=True)

    def __post_init__(self) -> None:
        Model.__post_init__(self)
        if not _NAME.match(self.spec):
            raise ConfigurationError(
                f"Deployments name {self.spec!r}: a letter, then up to 63 letters, digits, '_', '.' or '-'"
            )
        deployments = tuple(self.deployments) if isinstance(self.deployments, Sequence) else ()
        if not deployments or not all(isinstance(each, Deployment) for each in deployments):
            raise ConfigurationError(f"Deployments {self.spec!r}: a list of guards.Deployment, at least one")
        if len(deployments) > MAX_DEPLOYMENTS:
            raise ConfigurationError(f"Deployments {self.spec!r}: at most {MAX_DEPLOYMENTS} deployments")
        names = [each.name for each in deployments]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"Deployments {self.spec!r}: each deployment's name once")
        if self.strategy not in _STRATEGIES:
            raise ConfigurationError(
                f"Deployments {self.spec!r}: strategy must be one of {', '.join(_STRATEGIES)}; got {self.strategy!r}"
            )
        object.__setattr__(self, "deployments", deployments)

    def key(self, deployment: Deployment) -> str:
        """The model key of `deployment` in this group: `group/name`."""
        return f"{self.spec}/{deployment.name}"


@settings
@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """A named model with the profiles to fall back on after it.

    `model` is a chain entry naming one model (`"openai:gpt-4o-mini"` or a main-binding id),
    or a `Model` giving it call limits of its own; `fallbacks` names other profiles, tried in
    order after this one (each with its own fallbacks, depth-first).
    """

    model: str | Model
    fallbacks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.model, str | Model):
            raise ConfigurationError(
                f"Profile.model must be one chain entry (a model id or 'provider:model', or a "
                f"guards.Model); got {self.model!r}"
                + (
                    ": the profiles to fall back on go in fallbacks=..."
                    if isinstance(self.model, list | tuple)
                    else ""
                )
            )
        if isinstance(self.fallbacks, str) or not all(isinstance(each, str) for each in self.fallbacks):
            raise ConfigurationError(
                f"Profile.fallbacks must be a tuple of profile names, e.g. fallbacks=({self.fallbacks!r},); "
                f"got {self.fallbacks!r}"
            )


@dataclass(frozen=True, slots=True)
class Chain:
    """A flattened chain: the models in call order, and what was removed on the way."""

    models: tuple[ModelRef, ...]
    problems: tuple[str, ...] = ()


def flatten_chain(
    entries: Sequence[str | Model],
    *,
    profiles: Mapping[str, Profile] | None = None,
    providers: Collection[str] = (),
    hints: Mapping[str, str] | None = None,
) -> Chain:
    """Flatten `entries` (model specs, `hint:name` and profile names, each a string or a
    `Model`) into an ordered chain of models.

    `providers` are the provider names a `"provider:model"` entry may use besides `"default"`;
    `hints` maps hint names to their targets (a model spec or a profile name). A `Model`'s
    limits go to every model its spec names, except where a profile's own `Model` sets its
    own. Problems that can be fixed by removing an entry are reported in `Chain.problems`
    (each a short sentence naming the entry), and so is an unknown hint (`entry 'hint:x':
    unknown hint`), kept as the literal model id; raises `ConfigurationError` for a provider
    prefix that names no configured provider.
    """
    profiles = profiles or {}
    hints = hints or {}
    known = {DEFAULT_PROVIDER, *providers}
    models: list[ModelRef] = []
    problems: list[str] = []
    seen: set[str] = set()

    def add(entry: str | Model, where: str, hint: str | None, outer: Limits) -> None:
        if isinstance(entry, Deployments):
            for member in group_models(entry, known, _inner(entry.limits, outer)):
                if member.key in seen:
                    problems.append(f"{where}: duplicate model {member.key!r} removed")
                else:
                    seen.add(member.key)
                    models.append(replace(member, hint=hint))
            return
        spec, own = entry_parts(entry)
        ref = parse_model(spec, known)
        if ref is None:
            problems.append(f"{where}: empty model id removed")
        elif ref.key in seen:
            problems.append(f"{where}: duplicate model {ref.key!r} removed")
        else:
            seen.add(ref.key)
            first_output_s, stream_idle_s, min_chars_per_s = _inner(own, outer)
            models.append(
                ModelRef(
                    ref.provider,
                    ref.model,
                    hint,
                    first_output_s=first_output_s,
                    stream_idle_s=stream_idle_s,
                    min_chars_per_s=min_chars_per_s,
                )
            )

    def expand(name: str, path: tuple[str, ...], hint: str | None, outer: Limits) -> None:
        where = " -> ".join((*path, name))
        if name in path:
            problems.append(f"{where}: cycle removed")
            return
        if len(path) >= MAX_PROFILE_DEPTH:
            problems.append(f"{where}: deeper than {MAX_PROFILE_DEPTH} profiles, removed")
            return
        profile = profiles[name]
        add(profile.model, f"profile {name!r}", hint, outer)
        for reference in profile.fallbacks:
            if reference not in profiles:
                problems.append(f"{where}: fallback {reference!r} names no profile, removed")
            else:
                expand(reference, (*path, name), hint, outer)

    for item in entries:
        if isinstance(item, Deployments):
            add(item, f"entry {item.spec!r}", None, _NO_LIMITS)
            continue
        entry, limits = entry_parts(item)
        entry = entry.strip()
        hint = None
        if entry.startswith(HINT_PREFIX):
            name = entry[len(HINT_PREFIX) :].strip()
            target = hints.get(name)
            if target is None:
                problems.append(f"entry {entry!r}: unknown hint")
                # Kept as the literal model id, on the main binding.
                add(f"{DEFAULT_PROVIDER}:{entry}", f"entry {entry!r}", None, limits)
                continue
            hint, entry = name, target.strip()
        if entry in profiles:
            expand(entry, (), hint, limits)
        else:
            add(entry, f"entry {entry!r}", hint, limits)
    return Chain(tuple(models), tuple(problems))


def group_models(group: Deployments, providers: Collection[str], limits: Limits) -> list[ModelRef]:
    """The models of a group of deployments, in its order, each with `limits`; raises
    `ConfigurationError` for a deployment whose provider is not configured."""
    models = []
    for deployment in group.deployments:
        provider = deployment.provider.strip()
        if provider not in providers:
            raise ConfigurationError(
                f"deployment {group.key(deployment)!r} names provider {provider!r}, which is not "
                f"configured: give its credentials (Guards(providers={{{provider!r}: ...}}))"
            )
        first_output_s, stream_idle_s, min_chars_per_s = limits
        models.append(
            ModelRef(
                None if provider == DEFAULT_PROVIDER else provider,
                deployment.model.strip(),
                first_output_s=first_output_s,
                stream_idle_s=stream_idle_s,
                min_chars_per_s=min_chars_per_s,
                deployment=deployment,
                group=group,
            )
        )
    return models


def check_hints(hints: Mapping[str, str]) -> dict[str, str]:
    """`hints` as `Guards` keeps them; raises `ConfigurationError` for a hint name that is not
    a short token (it becomes a metric label value) or a target that is empty or another hint
    (a hint names a model or a profile: no chains of hints)."""
    checked = {}
    for name, target in hints.items():
        if not isinstance(name, str) or not _HINT_NAME.match(name):
            raise ConfigurationError(
                f"hint name {name!r}: a letter, then up to 63 letters, digits, '_', '.' or '-'"
            )
        if not isinstance(target, str) or not target.strip():
            raise ConfigurationError(f"hint {name!r} names no model")
        if target.strip().startswith(HINT_PREFIX):
            raise ConfigurationError(f"hint {name!r} names another hint: name a model or a profile")
        checked[name] = target.strip()
    return checked


def parse_model(entry: str, providers: Collection[str]) -> ModelRef | None:
    """One model spec as a `ModelRef`; None for an empty model id. `provider:model` names a
    configured provider; a first part with a dot that names none is part of the main binding's
    model id (Bedrock's ids: `amazon.nova-lite-v1:0`)."""
    entry = entry.strip()
    prefix, colon, rest = entry.partition(":")
    if colon and _PROVIDER.match(prefix) and not prefix.startswith("@"):
        if prefix not in providers and "." in prefix:
            # A model id with a colon whose first part has a dot (Bedrock's
            # `anthropic.claude-3-5-haiku-20241022-v1:0`) names no provider: the main binding's.
            return ModelRef(None, entry)
        if prefix not in providers:
            raise ConfigurationError(
                f"model {entry!r} names provider {prefix!r}, which is not configured: give its "
                f"credentials (Guards(providers={{{prefix!r}: ...}})), or write "
                f"'{DEFAULT_PROVIDER}:{entry}' for a main-binding model id that contains ':'"
            )
        rest = rest.strip()
        if not rest:
            return None
        return ModelRef(None if prefix == DEFAULT_PROVIDER else prefix, rest)
    return ModelRef(None, entry) if entry else None
