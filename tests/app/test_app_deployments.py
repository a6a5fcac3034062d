"""The example app's deployments (`AI_DEPLOYMENTS`, `AI_DEPLOYMENT_STRATEGY`,
`AI_DEPLOYMENT_RPM`): two deployments of the provider, each a binding of its own, over real HTTP
against the fake Workers AI server; off by default (a bad value failing start-up: with the
app's other settings, tests/app/test_app_limits.py); and every setting of the app is in
docs/example-app.md's table."""

from __future__ import annotations

import re
from pathlib import Path

from app.settings import Settings
from fixtures import Fail, FakeWorkersAI, Reply, Stream, Text

from ..conftest import ExampleClient

MODEL = "@cf/test/model"
ASK = {"message": "Where is my parcel? It was due on Monday."}
ANSWER = Reply("Thank you for your message.")


def test_two_deployments_of_the_provider_share_the_draft_routes(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = ANSWER
    client = example_client(ai_deployments="east=3,west=1")
    served = []
    for _ in range(40):
        response = client.post("/draft-reply", json=ASK)
        assert response.status_code == 200, response.text
        served.append(response.headers["x-ai-deployment"])
    assert served.count("draft/east") > served.count("draft/west") > 0
    assert {call.model for call in fake_workers_ai.calls} == {MODEL}
    status = client.get("/status").json()
    assert {"draft/east", "draft/west"} <= {entry["model"] for entry in status["models"]}


def test_a_deployment_at_its_rpm_leaves_the_rest_to_the_other(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = ANSWER
    client = example_client(ai_deployments="east=1,west=1", ai_deployment_rpm=3)
    served = [client.post("/draft-reply", json=ASK).headers.get("x-ai-deployment") for _ in range(8)]
    assert sorted(served[:6]) == ["draft/east"] * 3 + ["draft/west"] * 3
    assert len(fake_workers_ai.calls) == 6  # both at their limit: no call
    assert client.post("/draft-reply", json=ASK).status_code == 503


def test_without_deployments_the_draft_routes_call_the_model(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI
) -> None:
    fake_workers_ai.default = ANSWER
    response = example_client().post("/draft-reply", json=ASK)
    assert response.status_code == 200
    assert "x-ai-deployment" not in response.headers


def test_every_setting_is_in_the_example_app_pages_table() -> None:
    page = (Path(__file__).parents[2] / "docs" / "example-app.md").read_text()
    # Each row's first cell: the variables it documents.
    cells = re.findall(r"^\| ([^|]*`[A-Z][A-Z0-9_]+`[^|]*) \|", page, re.M)
    names = {name for cell in cells for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)}
    assert {field.upper() for field in Settings.model_fields} - names == set()


def test_a_stream_that_fails_on_one_deployment_streams_from_the_other(
    example_client: ExampleClient, fake_workers_ai: FakeWorkersAI
) -> None:
    """The first deployment tried fails before any output; the other streams the answer, and
    the stream's headers name it."""
    fake_workers_ai.script(MODEL, Fail(code=5035, status=403))
    fake_workers_ai.default = Stream(parts=(Text("Thank you."),))
    client = example_client(ai_deployments="east=1,west=1")
    response = client.post("/draft-reply/stream", json=ASK)
    assert response.status_code == 200
    assert "event: done" in response.text
    assert response.headers["x-ai-deployment"] in {"draft/east", "draft/west"}
    assert "x-ai-fallback" not in response.headers
    assert len(fake_workers_ai.calls) == 2
