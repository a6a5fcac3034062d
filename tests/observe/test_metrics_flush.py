"""The metrics flush survives a series prometheus-client refuses an amount of: that amount is
dropped and said once (`metrics_flush_failed`, naming the metric, never the amount), and every
series, that one included, keeps counting. Over HTTP through uvicorn."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Response

from guards import AI, AIResult, Guards, Usage, render_metrics

from ..conftest import LogLines, Serve, guards_samples

#: A model of this test's own: its series are touched by no other test.
MODEL = "@cf/test/enormous-usage"
#: A count no float holds: a binding of the app's own may report anything.
ENORMOUS = 10**400


class OwnBinding:
    """A binding of the app's own, which reports the usage it is told to (`usage`)."""

    def __init__(self, usage: Usage) -> None:
        self.usage = usage

    async def run(self, model: str, inputs: Mapping[str, Any]) -> AIResult:
        return AIResult("hi", model, usage=self.usage)

    async def aclose(self) -> None:
        pass


def app_of(binding: OwnBinding) -> FastAPI:
    guards = Guards(binding)
    app = FastAPI()
    guards.install(app)

    @app.post("/echo")
    @guards.route(model=MODEL, fallback="later")
    async def echo(ai: AI[str]) -> str:
        return await ai.run({"prompt": "hello"})

    @app.get("/metrics")
    def metrics() -> Response:
        payload, content_type = render_metrics()
        return Response(payload, media_type=content_type)

    return app


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_series_that_cannot_take_an_amount_stops_no_series(serve: Serve, guards_log: LogLines) -> None:
    binding = OwnBinding(Usage(prompt_tokens=ENORMOUS, completion_tokens=5))
    client = serve(app_of(binding))
    before = guards_samples(client)
    assert client.post("/echo").json()["fallback"] is None
    first = guards_samples(client)  # the input tokens' amount is refused: dropped, the rest written
    binding.usage = Usage(prompt_tokens=10, completion_tokens=5)
    assert client.post("/echo").json()["fallback"] is None
    second = guards_samples(client)
    for samples, requests in ((first, 1), (second, 2)):
        assert (
            value(samples, "guards_requests_total", route="echo", outcome="ok")
            - value(before, "guards_requests_total", route="echo", outcome="ok")
            == requests
        )
        assert value(samples, "guards_tokens_total", model=MODEL, type="output") == 5 * requests
    assert value(first, "guards_tokens_total", model=MODEL, type="input") == 0
    assert value(second, "guards_tokens_total", model=MODEL, type="input") == 10  # it counts again
    [failed] = guards_log.events("metrics_flush_failed")
    assert failed == {"event": "metrics_flush_failed", "metric": "guards_tokens", "error": "OverflowError"}
