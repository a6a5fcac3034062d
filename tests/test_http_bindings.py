"""What every HTTP binding promises alike, checked on each (`WorkersAI`, `OpenAICompatible`)
against its fake server: cancellation closes the connection, and `aclose` closes only a client
the binding made itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest

from fixtures import FakeOpenAI, FakeWorkersAI, Hang, Reply
from guards import AIResult, Binding
from guards.providers import OpenAICompatible, WorkersAI

INPUTS: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}]}


@dataclass
class Provider:
    """A running fake server, the model it serves, and how to make a binding for it."""

    server: FakeWorkersAI | FakeOpenAI
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


@pytest.fixture(params=[_workers_ai, _openai], ids=["workers-ai", "openai"])
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
        async with httpx.AsyncClient() as client:
            first = provider.binding(client=client)
            second = provider.binding(client=client)
            await first.run(provider.model, INPUTS)
            await first.aclose()
            assert not client.is_closed
            assert (await second.run(provider.model, INPUTS)).model == provider.model

    asyncio.run(scenario())
    assert len(provider.server.calls) == 2
