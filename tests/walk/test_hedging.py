"""Hedged requests (`route(hedge=Hedge(...))`), over real HTTP against the fake Workers AI server:
a slow model's tail is cut by a second attempt on the next model, the first answer wins and the
other attempt's connection is closed and billed as a cancelled call; hedges stay within the
retry budget and the deadline; a call with tools and a stream past its first output are never
hedged; a stream hedged before its first output serves the stream that produced output first;
`after="p95"` follows the model's recent calls. Every wait is bounded by the route's deadline
or a stated limit; none is a sleep."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Response
from pydantic import BaseModel

from fixtures import FakeWorkersAI, Hang, Reply, Stream, Text
from guards import (
    AI,
    Budget,
    Deployment,
    Deployments,
    EventStream,
    Guards,
    Hedge,
    Price,
    Retry,
    RetryBudget,
    render_metrics,
)
from guards.providers import WorkersAI

from ..conftest import LogLines, Serve, guards_samples, no_sleep

SLOW, FAST = "@cf/test/slow", "@cf/test/fast"
#: Slack for a loaded machine: how long the fake server gets to see a connection closed.
SLACK_S = 2.0
#: The route's deadline: far longer than any answer here.
TIMEOUT_S = 8.0


class Lookup(BaseModel):
    order: str


def hedged_app(
    server: FakeWorkersAI, hedge: Hedge | None, *, retry: Retry | None = None, timeout_s: float = TIMEOUT_S
) -> FastAPI:
    """Routes on the chain SLOW, FAST: `/reply` (plain), `/tools` (with a tool), `/stream`."""
    guards = Guards(
        WorkersAI(account_id=server.account_id, api_token=server.api_token, base_url=server.base_url),
        sleep=no_sleep,
    )
    app = FastAPI()
    guards.install(app)
    chain: dict[str, Any] = {
        "model": SLOW,
        "fallbacks": [FAST],
        "timeout_s": timeout_s,
        "breaker": None,
        "hedge": hedge,
        "retry": retry or Retry(),
    }

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    @app.post("/reply")
    @guards.route(**chain)
    async def reply(ai: AI[str]) -> str:
        return await ai.run({"prompt": "Where is my parcel?"})

    @app.post("/tools")
    @guards.route(**chain, name="tools", tools={"lookup": Lookup})
    async def tools(ai: AI[str]) -> str:
        return await ai.run({"prompt": "Where is my parcel?"})

    @app.post("/stream")
    @guards.route(**chain, name="stream")
    async def stream(ai: AI[str]) -> EventStream:
        return await ai.stream({"prompt": "Where is my parcel?"})

    return app


#: `guards_hedges_total` of a route (the model hedged: SLOW), by outcome.
Hedges = dict[str, float]


def hedges(client: httpx.Client, route: str = "reply", before: Hedges | None = None) -> Hedges:
    """`guards_hedges_total` of `route` by outcome (metrics are the process's: what grew since
    `before`)."""
    found: Hedges = {}
    for (name, labels), value in guards_samples(client).items():
        label = dict(labels)
        if name == "guards_hedges_total" and label["route"] == route and label["model"] == SLOW:
            grown = value - (before or {}).get(label["outcome"], 0.0)
            if grown:
                found[label["outcome"]] = grown
    return found


def streamed_text(response: httpx.Response) -> str:
    text = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if lines.get("event") == "delta":
            text.append(httpx.Response(200, content=lines["data"]).json()["text"])
    return "".join(text)


def disconnected(server: FakeWorkersAI, model: str) -> bool:
    """Whether the server saw the caller close the connection of `model`'s call, within SLACK_S."""
    return server.wait_for(lambda calls: any(c.model == model and c.disconnected for c in calls), SLACK_S)


async def burst(base_url: str, count: int, concurrency: int) -> list[tuple[float, str]]:
    """`count` requests to `/reply`, `concurrency` at a time: each one's latency in seconds and
    answer."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30) as client:

        async def one() -> tuple[float, str]:
            async with gate:
                started = time.perf_counter()
                response = await client.post("/reply", json={})
                assert response.status_code == 200, response.text
                return time.perf_counter() - started, str(response.json())

        return list(await asyncio.gather(*(one() for _ in range(count))))


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def group_app(server: FakeWorkersAI, hedge: Hedge | None, *, retry: Retry | None = None) -> FastAPI:
    """`/reply` on a group of two deployments: `chat/east` (model SLOW), first on every walk
    (weight 10^9 to 1), and `chat/west` (model FAST): a hedge of east goes to west."""
    binding = WorkersAI(account_id=server.account_id, api_token=server.api_token, base_url=server.base_url)
    guards = Guards(binding, providers={"east": binding, "west": binding}, sleep=no_sleep, seed=1)
    app = FastAPI()
    guards.install(app)
    east = Deployment("east", provider="east", model=SLOW, weight=10**9)
    chat = Deployments("chat", [east, Deployment("west", provider="west", model=FAST)])

    @app.post("/reply")
    @guards.route(model=chat, timeout_s=TIMEOUT_S, breaker=None, hedge=hedge, retry=retry or Retry())
    async def reply(ai: AI[str]) -> str:
        return await ai.run({"prompt": "Where is my parcel?"})

    return app


#: The tail test: deployment east answers in FAST_S, but every 20th call in TAIL_S; west in 10 ms. (A hedged
#: call takes HEDGE_AFTER_S plus FAST's 10 ms: below twice FAST_S, the fast calls' least p99,
#: with room for a loaded machine's added latency, which inflates both sides.)
REQUESTS, CONCURRENCY, FAST_S, TAIL_S, HEDGE_AFTER_S = 200, 20, 0.2, 1.5, 0.3
#: The tail test's retry budget: half the requests may hedge, so that fast calls a loaded machine
#: slowed past the delay cannot spend the hedges the slow ones need (the budget's bound has a
#: test of its own below).
TAIL_BUDGET = RetryBudget(share=0.5)


@pytest.mark.serial  # latencies compared to each other: the machine to itself
def test_a_slow_deployments_tail_is_hedged(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    """1 call in 20 to a deployment is slow. Unhedged, the p99 is that slow call; hedged after
    HEDGE_AFTER_S on the group's other deployment (which answers in 10 ms), the p99 is below
    twice the p99 of the fast calls (the unhedged run's requests the first answered fast)."""

    def run(hedge: Hedge | None) -> list[tuple[float, str]]:
        fake_workers_ai.reset()
        tail, fast = Reply("tail", delay_s=TAIL_S), Reply("first", delay_s=FAST_S)
        fake_workers_ai.script(SLOW, *[tail if n % 20 == 19 else fast for n in range(REQUESTS)])
        fake_workers_ai.script(FAST, *[Reply("hedge", delay_s=0.01)] * REQUESTS)
        client = serve(group_app(fake_workers_ai, hedge, retry=Retry(budget=TAIL_BUDGET)))
        return asyncio.run(burst(str(client.base_url), REQUESTS, CONCURRENCY))

    # Two runs' latencies compared on a shared machine: a pair that a load spike put out of the
    # bound is measured again, once. Without hedging, both pairs fail (the tail is TAIL_S).
    for pair in range(2):
        unhedged = run(None)
        fast = [latency for latency, answer in unhedged if answer == "first"]
        assert len(fast) == REQUESTS - REQUESTS // 20
        hedged = run(Hedge(after_s=HEDGE_AFTER_S))
        answers = [answer for _, answer in hedged]
        hedged_p99 = p99([latency for latency, _ in hedged])
        print(
            f"pair {pair + 1}: p99 of fast calls {p99(fast) * 1000:.0f} ms, unhedged "
            f"{p99([t for t, _ in unhedged]) * 1000:.0f} ms, hedged after {HEDGE_AFTER_S * 1000:.0f} ms "
            f"{hedged_p99 * 1000:.0f} ms ({answers.count('hedge')} hedges won)"
        )
        assert p99([latency for latency, _ in unhedged]) >= TAIL_S  # unhedged, the tail is the slow call
        if hedged_p99 < 2 * p99(fast):
            break
    assert hedged_p99 < 2 * p99(fast)
    # The slow calls, and a few fast ones a loaded machine made slower than the delay.
    assert REQUESTS // 20 - 1 <= answers.count("hedge") <= REQUESTS // 2 + 3  # the retry budget


def test_hedges_never_exceed_the_retry_budget(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    """Every call of the first model is slow; the retry budget admits 2 retries (or hedges)
    whatever the traffic: 2 hedges start, the other requests wait for their first model, and
    their hedges are counted as skipped."""
    fake_workers_ai.script(SLOW, *[Reply("slow", delay_s=0.3)] * 8)
    fake_workers_ai.script(FAST, *[Reply("fast")] * 8)
    budget = RetryBudget(share=0.0, min_retries=2)
    client = serve(hedged_app(fake_workers_ai, Hedge(after_s=0.05), retry=Retry(budget=budget)))
    before = hedges(client)
    answers = [client.post("/reply", json={}) for _ in range(8)]
    assert all(answer.status_code == 200 for answer in answers)
    assert [answer.json() for answer in answers].count("fast") == 2
    assert hedges(client, "reply", before) == {"started": 2, "won": 2, "skipped": 6}
    assert len(fake_workers_ai.calls_to(FAST)) == 2


def test_the_first_answer_wins_and_the_loser_is_cancelled_and_billed(
    fake_workers_ai: FakeWorkersAI, serve: Serve, guards_log: LogLines
) -> None:
    """The hedge answers first: the first model's call is closed (the fake sees it leave),
    and accounted as a cancelled call; the hedge's `attempt` line says it was one."""
    fake_workers_ai.script(SLOW, Hang())
    fake_workers_ai.script(FAST, Reply("fast"))
    client = serve(hedged_app(fake_workers_ai, Hedge(after_s=0.1)))
    before = hedges(client)
    started = time.perf_counter()
    answer = client.post("/reply", json={})
    assert answer.status_code == 200
    assert answer.json() == "fast"
    assert answer.headers["x-ai-fallback"] == FAST
    assert time.perf_counter() - started < TIMEOUT_S / 2
    assert disconnected(fake_workers_ai, SLOW)
    assert hedges(client, "reply", before) == {"started": 1, "won": 1}
    attempts = {line["model"]: line for line in guards_log.events("attempt")}
    assert attempts[SLOW]["outcome"] == "cancelled"
    assert "hedge" not in attempts[SLOW]
    assert attempts[FAST]["outcome"] == "ok"
    assert attempts[FAST]["hedge"] is True
    assert guards_log.events("request")[-1]["attempts"] == 2


#: Cost units per token (input, output), and per call; the most a call of the priced route outputs.
PRICE, MAX_TOKENS = Price(input_token=0.01, output_token=0.1, call=1.0), 50


def test_under_a_spend_cap_the_loser_costs_its_worst_case(
    fake_workers_ai: FakeWorkersAI, serve: Serve
) -> None:
    """Billed as a cancelled call is: the hedge's reported usage at its price, plus the first
    call's worst case (its usage unknown), in what the request cost (`ai.cost`)."""
    guards = Guards(
        WorkersAI(
            account_id=fake_workers_ai.account_id,
            api_token=fake_workers_ai.api_token,
            base_url=fake_workers_ai.base_url,
        ),
        prices={SLOW: PRICE, FAST: PRICE},
        sleep=no_sleep,
    )
    app = FastAPI()
    guards.install(app)

    @app.post("/priced")
    @guards.route(
        model=SLOW,
        fallbacks=[FAST],
        timeout_s=TIMEOUT_S,
        breaker=None,
        hedge=Hedge(after_s=0.1),
        budget=Budget(spend_per_day=1_000.0),
        max_tokens=MAX_TOKENS,
    )
    async def priced(ai: AI[str]) -> dict[str, Any]:
        answer = await ai.run({"prompt": "Where is my parcel?"})
        return {"answer": answer, "attempts": ai.attempts, "cost": ai.cost}

    fake_workers_ai.script(SLOW, Hang())
    fake_workers_ai.script(FAST, Reply("fast", usage={"prompt_tokens": 100, "completion_tokens": 20}))
    client = serve(app)
    answer = client.post("/priced", json={})
    assert answer.status_code == 200, answer.text
    assert disconnected(fake_workers_ai, SLOW)
    assert answer.json()["attempts"] == 2
    # The loser's worst case, as the spend cap holds it: one token per byte of the (short)
    # input, at most MAX_TOKENS out.
    loser = answer.json()["cost"] - PRICE.cost(100, 20)
    assert PRICE.most(1, MAX_TOKENS) <= loser <= PRICE.most(1_000, MAX_TOKENS)


def test_the_first_attempt_answering_first_cancels_the_hedge(
    fake_workers_ai: FakeWorkersAI, serve: Serve, guards_log: LogLines
) -> None:
    fake_workers_ai.script(SLOW, Reply("slow", delay_s=0.4))
    fake_workers_ai.script(FAST, Hang())
    client = serve(hedged_app(fake_workers_ai, Hedge(after_s=0.1)))
    before = hedges(client)
    answer = client.post("/reply", json={})
    assert answer.status_code == 200
    assert answer.json() == "slow"
    assert "x-ai-fallback" not in answer.headers
    assert disconnected(fake_workers_ai, FAST)
    assert hedges(client, "reply", before) == {"started": 1, "lost": 1}
    attempts = {line["model"]: line for line in guards_log.events("attempt")}
    assert (attempts[SLOW]["outcome"], attempts[FAST]["outcome"]) == ("ok", "cancelled")
    assert attempts[FAST]["hedge"] is True


def test_the_deadline_bounds_both_attempts(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    """Neither model answers: at the route's deadline both calls are closed, and the request
    ends then (the call guard's `timeout`)."""
    fake_workers_ai.script(SLOW, Hang())
    fake_workers_ai.script(FAST, Hang())
    client = serve(hedged_app(fake_workers_ai, Hedge(after_s=0.1), timeout_s=0.6))
    before = hedges(client)
    started = time.perf_counter()
    answer = client.post("/reply", json={})
    assert answer.status_code == 503
    assert answer.json()["error"] == "model_temporarily_unavailable"
    assert time.perf_counter() - started < 0.6 + SLACK_S
    assert disconnected(fake_workers_ai, SLOW)
    assert disconnected(fake_workers_ai, FAST)
    assert hedges(client, "reply", before) == {"started": 1}


def test_a_call_with_tools_is_never_hedged(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    fake_workers_ai.script(SLOW, Reply("slow", delay_s=0.4))
    client = serve(hedged_app(fake_workers_ai, Hedge(after_s=0.05)))
    before = hedges(client, "tools")
    answer = client.post("/tools", json={})
    assert answer.status_code == 200
    assert answer.json() == "slow"
    assert fake_workers_ai.calls_to(FAST) == []
    assert hedges(client, "tools", before) == {}


def test_a_stream_past_its_first_output_is_never_hedged(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    """The first model's first word comes before the hedge's delay, the rest well after it:
    committed at its first word, never hedged."""
    words = tuple(Text(word) for word in ("One ", "word ", "at ", "a ", "time."))
    fake_workers_ai.script(SLOW, Stream(parts=words, interval_s=0.1))
    client = serve(hedged_app(fake_workers_ai, Hedge(after_s=0.3)))
    before = hedges(client, "stream")
    answer = client.post("/stream", json={})
    assert answer.status_code == 200
    assert streamed_text(answer) == "One word at a time."
    assert fake_workers_ai.calls_to(FAST) == []
    assert hedges(client, "stream", before) == {}


def test_a_stream_hedged_before_its_first_output_serves_the_first_stream(
    fake_workers_ai: FakeWorkersAI, serve: Serve
) -> None:
    fake_workers_ai.script(SLOW, Stream(parts=(Text("Too late."),), delay_s=TIMEOUT_S))
    fake_workers_ai.script(FAST, Stream(parts=(Text("From the "), Text("hedge."))))
    client = serve(hedged_app(fake_workers_ai, Hedge(after_s=0.1)))
    before = hedges(client, "stream")
    answer = client.post("/stream", json={})
    assert answer.status_code == 200
    assert streamed_text(answer) == "From the hedge."
    assert answer.headers["x-ai-fallback"] == FAST
    assert disconnected(fake_workers_ai, SLOW)
    assert hedges(client, "stream", before) == {"started": 1, "won": 1}


def test_the_p95_delay_follows_the_models_recent_calls(fake_workers_ai: FakeWorkersAI, serve: Serve) -> None:
    """`Hedge(after="p95")`: `default_s` until `min_calls` calls were timed, then the model's
    p95 to first output (at least `floor_s`)."""
    hedge = Hedge(after="p95", default_s=1.0, min_calls=10, floor_s=0.05)
    client = serve(hedged_app(fake_workers_ai, hedge))
    before = hedges(client)
    fake_workers_ai.script(SLOW, Hang())
    fake_workers_ai.script(FAST, *[Reply("fast")] * 2)
    started = time.perf_counter()
    assert client.post("/reply", json={}).json() == "fast"  # hedged after default_s
    assert time.perf_counter() - started >= 1.0
    fake_workers_ai.script(SLOW, *[Reply("slow", delay_s=0.02)] * 10, Hang())
    assert all(client.post("/reply", json={}).json() == "slow" for _ in range(10))
    started = time.perf_counter()
    assert client.post("/reply", json={}).json() == "fast"  # hedged after the p95: well below 1 s
    assert time.perf_counter() - started < 0.8
    assert hedges(client, "reply", before) == {"started": 2, "won": 2}


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"after_s": 0.5, "after": "p95"}, {"after_s": 0}, {"after": "p50"}, {"after": "p95", "floor_s": -1}],
)
def test_a_hedge_is_declared_with_one_delay(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="Hedge"):
        Hedge(**kwargs)


def test_a_slow_deployment_is_hedged_on_another_deployment_of_its_group(
    fake_workers_ai: FakeWorkersAI, serve: Serve
) -> None:
    """In a group of deployments, the next leg of the walk is the group's next deployment: the
    hedge goes there, and the answer names the deployment that served."""
    fake_workers_ai.script(SLOW, Hang())
    fake_workers_ai.script(FAST, Reply("west"))
    answer = serve(group_app(fake_workers_ai, Hedge(after_s=0.1))).post("/reply", json={})
    assert answer.status_code == 200
    assert answer.json() == "west"
    assert answer.headers["x-ai-deployment"] == "chat/west"
    assert disconnected(fake_workers_ai, SLOW)
