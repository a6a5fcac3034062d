"""A guarded handler may declare what any FastAPI handler may: the `Request`, the `Response`
(to set a header or a cookie) and `BackgroundTasks`. FastAPI fills one parameter of each of
these kinds per endpoint, so guards uses the handler's own where it declares one, and adds its
own only where it does not. Served through Starlette's test client, which runs background tasks before it returns."""

from __future__ import annotations

from fastapi import BackgroundTasks, FastAPI, Request, Response
from pydantic import BaseModel

from fixtures import FakeBinding, Reply
from guards import AI, Guards, Task

from ..conftest import AppClient

MODEL = "@cf/test/model"


class Ask(BaseModel):
    text: str


class Label(BaseModel):
    label: str


def test_a_handler_gets_its_own_request_response_and_background_tasks(app_client: AppClient) -> None:
    binding = FakeBinding()
    binding.script(MODEL, Reply({"label": "shipping"}), Reply({"label": "billing"}))
    guards = Guards(binding)
    app = FastAPI()
    guards.install(app)
    ran: list[str] = []

    @app.post("/label")
    @guards.route(model=MODEL)
    async def label(
        body: Ask, request: Request, response: Response, tasks: BackgroundTasks, ai: AI[Label]
    ) -> Label:
        response.headers["x-seen"] = request.headers["x-who"]
        response.set_cookie("visited", "yes")
        tasks.add_task(ran.append, body.text)
        return await ai.run({"prompt": body.text})

    @app.post("/plain")
    @guards.route(model=MODEL, fallback=Label(label="unknown"))
    async def plain(request: Request, ai: AI[Label]) -> Label:
        return await ai.run({"prompt": request.url.path})

    client = app_client(app)  # in process: the background task has run when the answer is read
    answer = client.post("/label", json={"text": "where is my parcel"}, headers={"x-who": "ann"})
    assert answer.status_code == 200
    assert answer.json() == {"label": "shipping"}
    assert answer.headers["x-seen"] == "ann"
    assert answer.cookies["visited"] == "yes"
    assert answer.headers["x-ai-model"] == MODEL  # guards' own headers, on the same response
    assert answer.headers["x-trace-id"]
    assert ran == ["where is my parcel"]
    degrading = client.post("/plain")
    assert degrading.status_code == 200
    assert degrading.json()["data"] == {"label": "billing"}
    assert binding.calls[1].inputs["prompt"] == "/plain"


def test_a_task_route_gets_the_handlers_own_response(app_client: AppClient) -> None:
    binding = FakeBinding()
    binding.script(MODEL, Reply({"label": "shipping"}))
    guards = Guards(binding)
    app = FastAPI()
    guards.install(app)

    @app.post("/label")
    @guards.route(model=MODEL, task=Task())
    async def label(body: Ask, response: Response, ai: AI[Label]) -> Label:
        response.headers["x-handled"] = "yes"
        return await ai.run({"prompt": body.text})

    client = app_client(app, socket=True)
    answer = client.post("/label", json={"text": "hi"}, headers={"idempotency-key": "k-1"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-handled"] == "yes"
    again = client.post("/label", json={"text": "hi"}, headers={"idempotency-key": "k-1"})
    assert again.json() == answer.json()
    assert len(binding.calls) == 1
