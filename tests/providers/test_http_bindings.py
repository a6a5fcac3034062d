"""What every HTTP binding promises alike, checked on each (`WorkersAI`, `OpenAICompatible`,
`AzureOpenAI`, `Bedrock`)
against its fake server: cancellation closes the connection, and `aclose` closes only a client
the binding made itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from app.service import create_app
from fixtures import FakeAzureOpenAI, FakeBedrock, FakeOpenAI, FakeWorkersAI, Hang, Raw, Reply
from fixtures.fake_bedrock import bedrock_wire
from fixtures.script import openai_wire, workers_ai_wire
from guards import AIResult, Binding, Kind, ProviderError, classify
from guards.providers import AzureOpenAI, Bedrock, OpenAICompatible, WorkersAI, http_library

from ..conftest import AppClient, assert_error, workers_ai_settings

INPUTS: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}]}


@dataclass
class Provider:
    """A running fake server, the model it serves, and how to make a binding for it."""

    server: FakeWorkersAI | FakeOpenAI | FakeBedrock
    model: str
    make: Callable[..., Binding]

    def binding(self, **overrides: Any) -> Binding:
        return self.make(**overrides)


def _workers_ai() -> tuple[FakeWorkersAI | FakeOpenAI, str, Callable[..., Binding]]:
    server = FakeWorkersAI()

    def make(**overrides: Any) -> Binding:
        options = {
            "account_id": server.account_id,
            "api_token": server.api_token,
            "base_url": server.base_url,
        }
        return WorkersAI(**{**options, **overrides})

    return server, "@cf/meta/llama-3.3-70b-instruct-fp8-fast", make


def _openai() -> tuple[FakeWorkersAI | FakeOpenAI, str, Callable[..., Binding]]:
    server = FakeOpenAI()

    def make(**overrides: Any) -> Binding:
        return OpenAICompatible(**{"api_key": server.api_key, "base_url": server.base_url, **overrides})

    return server, "gpt-4o-mini", make


def _azure_openai() -> tuple[FakeAzureOpenAI, str, Callable[..., Binding]]:
    server = FakeAzureOpenAI()

    def make(**overrides: Any) -> Binding:
        return AzureOpenAI(**{"api_key": server.api_key, "endpoint": server.endpoint, **overrides})

    return server, "gpt-4o-mini-prod", make


def _bedrock() -> tuple[FakeBedrock, str, Callable[..., Binding]]:
    server = FakeBedrock()

    def make(**overrides: Any) -> Binding:
        options = {
            "region": server.region,
            "endpoint_url": server.base_url,
            "aws_access_key_id": server.access_key_id,
            "aws_secret_access_key": server.secret_access_key,
        }
        return Bedrock(**{**options, **overrides})

    return server, "anthropic.claude-3-5-haiku-20241022-v1:0", make


@pytest.fixture(
    params=[_workers_ai, _openai, _azure_openai, _bedrock],
    ids=["workers-ai", "openai", "azure-openai", "bedrock"],
)
def provider(request: pytest.FixtureRequest) -> Iterator[Provider]:
    server, model, make = request.param()
    with server:
        yield Provider(server, model, make)


async def _wait_for_timeout(coro: Coroutine[Any, Any, AIResult]) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(coro, 0.3)


async def _fail_after_timeout(coro: Coroutine[Any, Any, AIResult]) -> None:
    with pytest.raises(TimeoutError), anyio.fail_after(0.3):
        await coro


@pytest.mark.parametrize(
    "deadline",
    [pytest.param(_wait_for_timeout, id="asyncio.wait_for"), pytest.param(_fail_after_timeout, id="anyio")],
)
def test_deadline_closes_the_connection(
    provider: Provider, deadline: Callable[[Coroutine[Any, Any, AIResult]], Coroutine[Any, Any, None]]
) -> None:
    """Cancellation really stops the call: the server sees the client hang up while the binding
    is still open, not only once its client is closed."""
    server, model = provider.server, provider.model
    server.script(model, Hang())

    async def scenario() -> None:
        binding = provider.binding()
        try:
            await deadline(binding.run(model, INPUTS))
            disconnected = await asyncio.to_thread(
                server.wait_for, lambda calls: calls and calls[-1].disconnected, 5
            )
            assert disconnected
            # The binding is still usable after a cancelled call.
            assert (await binding.run(model, INPUTS)).response == Reply().response
        finally:
            await binding.aclose()

    asyncio.run(scenario())


def test_aclose_closes_its_own_client(provider: Provider) -> None:
    async def scenario() -> None:
        binding = provider.binding()
        await binding.run(provider.model, INPUTS)
        await binding.aclose()
        with pytest.raises(RuntimeError, match="closed"):  # httpx refuses to send on a closed client
            await binding.run(provider.model, INPUTS)

    asyncio.run(scenario())
    assert len(provider.server.calls) == 1


def test_aclose_leaves_a_shared_client_open(provider: Provider) -> None:
    async def scenario() -> None:
        async with http_library.AsyncClient() as client:
            first = provider.binding(client=client)
            second = provider.binding(client=client)
            await first.run(provider.model, INPUTS)
            await first.aclose()
            assert not client.is_closed
            assert (await second.run(provider.model, INPUTS)).model == provider.model

    asyncio.run(scenario())
    assert len(provider.server.calls) == 2


# --- redirects ----------------------------------------------------------------------------------


def redirect(provider: Provider, status: int) -> Raw:
    """A redirect carrying a valid success answer, to the very address that was called (where
    the next scripted answer would be served, were it followed)."""
    server, model = provider.server, provider.model
    if isinstance(server, FakeBedrock):
        _, _, body = bedrock_wire(Reply("redirected"))
        location = f"{server.base_url}/model/{model}/converse"
    elif isinstance(server, FakeOpenAI):
        _, _, body = openai_wire(Reply("redirected"), model)
        location = f"{server.base_url}/chat/completions"
    else:
        _, _, body = workers_ai_wire(Reply("redirected"))
        location = f"{server.base_url}/accounts/{server.account_id}/ai/run/{model}"
    return Raw(status, body, "application/json", {"location": location})


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("streaming", [False, True], ids=["run", "stream"])
@pytest.mark.parametrize("follow", [False, True], ids=["default-client", "client-that-follows"])
def test_a_redirect_is_a_failure_never_followed(
    provider: Provider, status: int, streaming: bool, follow: bool
) -> None:
    """Any 3xx is `model_unavailable`: not parsed as success (even with a success body), not
    followed (even by a client made to follow redirects)."""
    server, model = provider.server, provider.model
    server.script(model, redirect(provider, status), Reply("followed"))

    async def call(binding: Any) -> None:
        if streaming:
            async for _ in binding.stream(model, INPUTS):
                pass
        else:
            await binding.run(model, INPUTS)

    async def scenario() -> ProviderError:
        async with http_library.AsyncClient(follow_redirects=follow) as client:
            with pytest.raises(ProviderError) as info:
                await call(provider.binding(client=client))
            return info.value

    error = asyncio.run(scenario())
    assert error.status == status
    assert classify(error).kind is Kind.model_unavailable
    assert len(server.calls) == 1


def test_a_redirect_over_http_is_model_unavailable(
    fake_workers_ai: FakeWorkersAI, app_client: AppClient
) -> None:
    client = app_client(create_app(workers_ai_settings(fake_workers_ai, ai_model="@cf/m")))
    provider = Provider(fake_workers_ai, "@cf/m", lambda **_: WorkersAI(account_id="a", api_token="t"))
    for path in ("/draft-reply", "/draft-reply/stream"):
        fake_workers_ai.reset()
        fake_workers_ai.script("@cf/m", redirect(provider, 307), Reply("followed"))
        assert_error(client.post(path, json={"message": "Hi"}), 503, "model_unavailable", False)
        assert len(fake_workers_ai.calls) == 1
