"""`make bench-instructions`: the guard pipeline's cost per request in CPU instructions.

Timings on a shared machine move by +-15 us between runs; instruction counts do not. This runs
the same two sides as `bench.py` (the bare awaited fake call; the same handler behind
`Guards.route`, called as FastAPI calls it) under valgrind's callgrind, which counts every
instruction the process executes, whatever else the machine does. Each side runs twice, with
`SHORT` and `LONG` requests after the same start-up, so the difference divided by
`LONG - SHORT` is the cost of one request alone. Needs `valgrind` on the PATH; takes a minute
or two (the runs go two at a time).

Prints `guard_overhead_instructions` (guarded minus bare, per request) for the fixtures'
`FakeBinding` and `const_guard_overhead_instructions` for a binding that returns a ready result;
then, beside the success path's whole count (`success_request_instructions`: the guarded route
answering with the ready result), `refused_request_instructions`: the same request on a
degrading route in an outage (its model failed, its breaker is open for the whole run), served
its fallback without a call, and `refused_over_success` (their ratio).

Then the whole request as the server hands it to the app (`asgi_<app>_request_instructions`):
the apps `make bench-http` serves (`bench/http_apps.py`: `bare`, `guarded` on the memory store
with its request line on, `bare_fallback`, `outage`), each called through its ASGI interface
(FastAPI's routing, dependencies, validation and serialization, guards' middlewares) with the
bench's request, no socket. `asgi_guarded_over_bare` and `asgi_outage_over_bare_fallback` are
the HTTP ratios' deterministic counterparts: what the app costs, without the server's and the
kernel's share, which both sides pay alike (the HTTP ratio is higher).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import Label
from guards import AI

#: The repository (the whole-ASGI runs import `bench.http_apps` from there).
ROOT = Path(__file__).resolve().parent.parent
SHORT = 1_000
LONG = 3_000
#: The whole-ASGI runs' request counts (a request costs about five times the endpoint's).
ASGI_SHORT = 200
ASGI_LONG = 1_200
#: The apps counted through their ASGI interface, and the pairs printed as ratios.
ASGI_APPS = ("bare", "guarded", "bare_fallback", "outage")
ASGI_RATIOS = (("guarded", "bare"), ("outage", "bare_fallback"))

#: The counts this bench is compared against (`make bench-instructions` prints each figure's
#: change from its reference): the walk's counts as re-based by issue 41 (the latency
#: histograms, attempt spans and the refused path's prepared envelope paid back), measured at
#: REFERENCE_AT. Counts differ between installs and machines: a change means something only
#: against a reference measured with the same install (re-measure it there, at that commit).
REFERENCE_AT = "issue 41's re-base, 2026-12-04, Python 3.11.7, a loaded machine"
REFERENCE = {
    "guard_overhead": 86_742,
    "const_guard_overhead": 82_881,
    "success_request": 114_389,
    "refused_request": 94_548,
}


def run_requests(side: str, binding_kind: str, count: int) -> None:
    """In the process valgrind watches: start up, then make `count` requests on one side."""
    from starlette.requests import Request
    from starlette.responses import Response

    from bench import INPUTS, MODEL, USERS, ConstantBinding, Label, guarded_endpoint, scope_for
    from fixtures import FakeBinding, Reply

    logging.getLogger("guards").setLevel(logging.WARNING)
    fake: Any = (
        FakeBinding(Reply({"label": "billing", "confidence": 0.9}))
        if binding_kind == "fake"
        else ConstantBinding()
    )
    if binding_kind == "refused":
        fake = FailingBinding()
        endpoint, request_param, response_param = refused_endpoint(fake)
    else:
        endpoint, request_param, response_param = guarded_endpoint(fake)
    requests = [Request(scope_for(f"user-{i}")) for i in range(USERS)]
    response = Response()

    async def main() -> None:
        if binding_kind == "refused":  # the outage: one failure opens the breaker
            await endpoint(**{request_param: requests[0], response_param: response})
            assert fake.calls == 1
        for i in range(count):
            if side == "bare":
                result = await fake.run(MODEL, INPUTS)
                Label.model_validate(result.response)
            else:
                response.raw_headers.clear()
                await endpoint(**{request_param: requests[i % USERS], response_param: response})
            await asyncio.sleep(0)
            if i % 1_000 == 999:
                fake.reset()  # the fake's call record is not what is measured

    asyncio.run(main())
    if binding_kind == "refused":
        assert fake.calls == 1, "the breaker let a call through: not the refused path"


class FailingBinding:
    """Every call fails (a provider's 500): the outage."""

    def __init__(self) -> None:
        self.calls = 0

    async def run(self, model: str, inputs: Mapping[str, Any]) -> Any:
        from guards import ProviderError

        self.calls += 1
        raise ProviderError("bench", status=500)

    async def aclose(self) -> None:
        return None

    def reset(self) -> None:
        return None


def refused_endpoint(fake: FailingBinding) -> tuple[Callable[..., Awaitable[Any]], str, str]:
    """`bench.guarded_endpoint`'s route, degrading (a static fallback), its breaker opened by
    one failure and open for longer than any run."""
    import inspect

    from starlette.requests import Request
    from starlette.responses import Response

    from bench import INPUTS, MODEL
    from guards import Breaker, Budget, Guards, Retry, header_key

    guards = Guards(fake)

    @guards.route(
        model=MODEL,
        budget=Budget(per_minute=10**9, per_day=10**9, key=header_key("x-user-id")),
        breaker=Breaker(failure_threshold=1, reset_timeout_s=86_400.0),
        retry=Retry(attempts=1),
        fallback=Label(label="unknown", confidence=0.0),
    )
    async def label(ai: AI[Label]) -> Label:
        return await ai.run(INPUTS)

    params = inspect.signature(label).parameters.values()
    request_param = next(p.name for p in params if p.annotation is Request)
    response_param = next(p.name for p in params if p.annotation is Response)
    return label, request_param, response_param


def count(side: str, binding_kind: str, requests: int) -> int:
    """Instructions of a whole process making `requests` requests on `side` (`asgi`: the app
    `binding_kind` names, through its ASGI interface)."""
    command = (
        [sys.executable, "-m", "bench.asgi_requests", binding_kind, str(requests)]
        if side == "asgi"
        else [sys.executable, __file__, side, binding_kind, str(requests)]
    )
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *command],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def per_request(side: str, binding_kind: str, pool: ThreadPoolExecutor) -> float:
    few, many = (ASGI_SHORT, ASGI_LONG) if side == "asgi" else (SHORT, LONG)
    short, long = pool.map(lambda n: count(side, binding_kind, n), (few, many))
    return (long - short) / (many - few)


def _against(name: str, count: float) -> str:
    """`count`'s change from its reference (`REFERENCE`), as printed beside it."""
    reference = REFERENCE[name]
    return f"  # {(count - reference) / reference:+.1%} against {reference:,} ({REFERENCE_AT})"


def main() -> None:
    if shutil.which("valgrind") is None:
        sys.exit("bench/instructions.py needs valgrind on the PATH (Debian: apt-get install valgrind)")
    with ThreadPoolExecutor(2) as pool:
        for binding_kind, name in (("fake", "guard_overhead"), ("const", "const_guard_overhead")):
            bare = per_request("bare", binding_kind, pool)
            guarded = per_request("guarded", binding_kind, pool)
            print(f"{name}_instructions = {guarded - bare:.0f} instructions{_against(name, guarded - bare)}")
        # The whole request (nothing subtracted): the const binding's success, and the outage's
        # refusal served its fallback.
        success = guarded
        refused = per_request("guarded", "refused", pool)
        print(
            f"success_request_instructions = {success:.0f} instructions{_against('success_request', success)}"
        )
        print(
            f"refused_request_instructions = {refused:.0f} instructions{_against('refused_request', refused)}"
        )
        print(f"refused_over_success = {refused / success:.3f} x")
        asgi = {name: per_request("asgi", name, pool) for name in ASGI_APPS}
        for name, figure in asgi.items():
            print(f"asgi_{name}_request_instructions = {figure:.0f} instructions")
        for name, baseline in ASGI_RATIOS:
            print(f"asgi_{name}_over_{baseline} = {asgi[name] / asgi[baseline]:.3f} x")


if __name__ == "__main__":
    if len(sys.argv) == 4:
        run_requests(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    else:
        main()
