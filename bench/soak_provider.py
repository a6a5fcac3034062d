"""The soak's provider (`make soak`): the fixtures' `FakeWorkersAI` in a process of its own,
failing a share of its calls in every way the README documents, and counting, per user and UTC
day, the `/summary` calls that reach it.

    python bench/soak_provider.py --seed 1 --failure-rate 0.1 --timeout-s 2

Once it serves, it prints one JSON line `{"port": N}`; then, for each line `report` on its
standard input, one JSON line of what it saw (see `Provider.report`); it stops at the end of its
standard input (the soak closed it, or died). Its own process: its event loop shares nothing
with the load generator's, and its CPU shows apart.

Each call is told apart by the inputs the example app sends: `"stream": true` is
`/draft-reply/stream`, a `response_format` is `/summary` (JSON mode), anything else is
`/draft-reply` (or a streaming route's one non-streaming recovery call after an empty stream).
The soak's users write `soak-u<n> q<i>` in their text (`soak-x q<i>` in requests the app must
reject before any call): the provider finds the user and the request there, so nothing in the
app changes, and a successful answer names its request (`Reply to q<i>.`, label `label q<i>`), so
the soak can tell an answer given to the wrong request.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import re
import resource
import sys
import threading
from collections import Counter
from typing import Any

from fixtures import Drop, Fail, FakeWorkersAI, Hang, Meta, Raw, Reply, Stream, Text
from fixtures.script import Outcome, wants_stream

ACCOUNT_ID = "soak-account"
API_TOKEN = "soak-token"
#: Where a soak request names its user and itself; `soak-x`: a request the app must refuse.
TOKEN = re.compile(r"soak-(u\d+|x) q(\d+)")

#: How the failing calls split, by weight; `shapes` lists the forms each takes.
FAILURES = {
    "timeout": 2.0,  # a hang, an answer past the deadline; a stream that stalls, trickles or never ends
    "3040": 2.0,  # Workers AI out of capacity (429; retried once); in-band in a stream after output
    "3036": 1.0,  # the daily quota spent (429; not retried; the model cools down)
    "5xx": 2.0,  # 500, 502 (a proxy's HTML page), 503 (the AiError shape), 504
    "cut": 1.5,  # the connection closed without an answer, a JSON body cut short; a stream cut
    "empty": 1.5,  # an empty or blank completion; a stream that completes with no text
}
#: The cooldown a 3036 asks for (`Retry-After`, seconds). Without it a 3036 would take the
#: route's only model out for 10 minutes (the documented default): the soak would then measure
#: `circuit_open` answers, not the failures.
QUOTA_RETRY_AFTER = "0.01"
#: Successful answers take this long at most (uniform), so requests overlap as they would.
LATENCY_S = 0.03


def reply_text(request: int) -> str:
    """The draft a successful call writes for request `request`."""
    return f"Reply to q{request}."


def reply_parts(request: int) -> tuple[Text, ...]:
    """The same, as a stream's three text events."""
    return (Text("Reply "), Text("to "), Text(f"q{request}."))


def summary_label(request: int) -> str:
    """The label a successful JSON-mode call answers for request `request`."""
    return f"label q{request}"


class Provider:
    """The `Chooser` of the soak's fake: one seeded random draw per call picks success or one of
    the failures (and its shape), and the `/summary` calls are counted per user and UTC day."""

    def __init__(self, seed: int, failure_rate: float, timeout_s: float) -> None:
        self.rng = random.Random(seed)
        self.failure_rate = failure_rate
        self.timeout_s = timeout_s
        self._names = list(FAILURES)
        self._weights = list(FAILURES.values())
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        #: (user, UTC day) -> [summary calls, distinct summary requests]
        self.users: dict[tuple[str, str], list[int]] = {}
        self._seen: set[int] = set()
        self.refused_calls = 0  # calls for requests the app should have refused
        self.unknown_calls = 0  # calls without a soak token

    def __call__(self, model: str, inputs: Any) -> Outcome:
        kind, user, request = call_of(inputs)
        with self._lock:
            if user is None:
                self.unknown_calls += 1
            elif user == "x":
                self.refused_calls += 1
            elif kind == "summary":
                key = (user, datetime.datetime.now(datetime.UTC).date().isoformat())
                counts = self.users.setdefault(key, [0, 0])
                counts[0] += 1
                if request not in self._seen:
                    self._seen.add(request)
                    counts[1] += 1
            failed = self.rng.random() < self.failure_rate
            name = self.rng.choices(self._names, self._weights)[0] if failed else "ok"
            self.outcomes[f"{kind} {name}"] += 1
            if name == "ok":
                return success(kind, request, delay_s=self.rng.uniform(0, LATENCY_S))
            return self.rng.choice(shapes(name, kind, request, self.timeout_s))

    def report(self) -> dict[str, Any]:
        """What the provider saw: calls per outcome (`"<kind> <outcome>"`), per user and UTC
        day the `/summary` calls and the distinct requests they served (`"user day": [calls,
        requests]`), calls for requests the app should have refused, calls without a token."""
        with self._lock:
            return {
                "outcomes": dict(self.outcomes),
                "users": {f"{user} {day}": counts for (user, day), counts in self.users.items()},
                "refused_calls": self.refused_calls,
                "unknown_calls": self.unknown_calls,
            }


def shapes(failure: str, kind: str, request: int, timeout_s: float) -> tuple[Outcome, ...]:
    """Every shape `failure` (a key of `FAILURES`, or "ok") takes for a call of `kind`
    (`summary`, `draft`, `stream`) serving request `request`; a failing call plays one of them."""
    parts = reply_parts(request)
    stream = kind == "stream"
    if failure == "ok":
        return (success(kind, request),)
    if failure == "timeout":
        if stream:
            return (
                Hang(),
                Stream(parts, stall_after=1),  # silent after the first word: the idle limit
                Stream(parts, stall_after=1, trickle=b": keep-alive\n", trickle_s=0.2),  # comments only
                Stream(parts[:1], endless=True, interval_s=0.05),  # never ends: the time limit
            )
        return (Hang(), success(kind, request, delay_s=timeout_s + 1.0))
    if failure == "3040":
        capacity = Fail(code=3040, status=429)
        return (capacity, Stream(parts, error_after=1, error_code=3040)) if stream else (capacity,)
    if failure == "3036":
        return (Fail(code=3036, status=429, retry_after=QUOTA_RETRY_AFTER),)
    if failure == "5xx":
        return (
            Fail(status=500),
            Raw(502, b"<html><body><h1>502 Bad Gateway</h1></body></html>"),
            Fail(status=503, shape="aierror"),
            Fail(status=504),
        )
    if failure == "cut":
        if stream:
            return (Stream(parts, cut_after=0), Stream(parts, cut_after=2, partial_tail=True))
        return (Drop(), Raw(200, b'{"result": {"response": "Reply to', content_type="application/json"))
    if failure == "empty":
        return (Stream(()), Stream((Meta(),))) if stream else (Reply(""), Reply(" \n\t "))
    raise ValueError(f"no such failure: {failure}")


def success(kind: str, request: int, *, delay_s: float = 0.0) -> Outcome:
    """The successful answer to request `request` for a call of `kind`."""
    if kind == "summary":
        return Reply({"label": summary_label(request), "confidence": 0.9}, delay_s=delay_s)
    if kind == "stream":
        return Stream(reply_parts(request), delay_s=delay_s)
    return Reply(reply_text(request), delay_s=delay_s)


def call_of(inputs: Any) -> tuple[str, str | None, int]:
    """A call's kind (`summary`, `draft`, `stream`), its user (`u<n>`, `x` for a request the app
    must refuse, None without a soak token) and its request number (0 without a token)."""
    kind = "stream" if wants_stream(inputs) else "summary" if "response_format" in inputs else "draft"
    found = TOKEN.search(_user_text(inputs))
    return kind, found[1] if found else None, int(found[2]) if found else 0


def _user_text(inputs: Any) -> str:
    messages = inputs.get("messages") if isinstance(inputs, dict) else None
    if not isinstance(messages, list):
        return ""
    return " ".join(
        str(m.get("content", "")) for m in messages if isinstance(m, dict) and m.get("role") == "user"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--failure-rate", type=float, default=0.1)
    parser.add_argument("--timeout-s", type=float, required=True, help="the app's AI_TIMEOUT_S")
    args = parser.parse_args()
    # Four workers' connection pools (100 each) and the hung calls: more than the usual 1,024.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    provider = Provider(args.seed, args.failure_rate, args.timeout_s)
    server = FakeWorkersAI(provider, account_id=ACCOUNT_ID, api_token=API_TOKEN)
    server.record = False  # a million calls: the provider's counts are the record
    with server:
        print(json.dumps({"port": server.port}), flush=True)
        for line in sys.stdin:
            if line.strip() == "report":
                print(json.dumps(provider.report()), flush=True)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
