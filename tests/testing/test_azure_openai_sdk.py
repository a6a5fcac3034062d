"""`FakeAzureOpenAI` as the official `openai` SDK's Azure client sees it (`AsyncAzureOpenAI`,
strict response validation on): its deployment addresses with `api-version`, the `api-key`
header and an Entra ID token, the v1 endpoint with `AsyncOpenAI`, and Azure's failures raising
the SDK's exceptions with Azure's codes. If the fake drifts from Azure's wire, these fail."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from fixtures import Fail, FakeAzureOpenAI, Reply, Stream, Text

DEPLOYMENT = "gpt-4o-mini-prod"
VERSION = "2024-10-21"
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def client(fake_azure_openai: FakeAzureOpenAI) -> AsyncIterator[openai.AsyncAzureOpenAI]:
    async with openai.AsyncAzureOpenAI(
        azure_endpoint=fake_azure_openai.endpoint,
        api_key=fake_azure_openai.api_key,
        api_version=VERSION,
        max_retries=0,
        timeout=5,
        _strict_response_validation=True,
    ) as sdk:
        yield sdk


@pytest.mark.anyio
async def test_a_reply_on_the_deployment_endpoint(
    client: openai.AsyncAzureOpenAI, fake_azure_openai: FakeAzureOpenAI
) -> None:
    fake_azure_openai.script(DEPLOYMENT, Reply("Hello there."))
    completion = await client.chat.completions.create(model=DEPLOYMENT, messages=MESSAGES)
    assert completion.choices[0].message.content == "Hello there."
    [call] = fake_azure_openai.calls
    assert (call.model, call.headers["api-key"]) == (DEPLOYMENT, fake_azure_openai.api_key)


@pytest.mark.anyio
async def test_an_entra_token(fake_azure_openai: FakeAzureOpenAI) -> None:
    async def token() -> str:
        return "test-entra-token"

    fake_azure_openai.script(DEPLOYMENT, Reply("Hello there."))
    async with openai.AsyncAzureOpenAI(
        azure_endpoint=fake_azure_openai.endpoint,
        azure_ad_token_provider=token,
        api_version=VERSION,
        max_retries=0,
        _strict_response_validation=True,
    ) as sdk:
        completion = await sdk.chat.completions.create(model=DEPLOYMENT, messages=MESSAGES)
    assert completion.choices[0].message.content == "Hello there."
    assert fake_azure_openai.calls[0].headers["authorization"] == "Bearer test-entra-token"


@pytest.mark.anyio
async def test_the_v1_endpoint(fake_azure_openai: FakeAzureOpenAI) -> None:
    fake_azure_openai.script(DEPLOYMENT, Reply("Hello there."))
    async with openai.AsyncOpenAI(
        base_url=fake_azure_openai.base_url,
        api_key=fake_azure_openai.api_key,
        max_retries=0,
        _strict_response_validation=True,
    ) as sdk:
        completion = await sdk.chat.completions.create(model=DEPLOYMENT, messages=MESSAGES)
    assert completion.choices[0].message.content == "Hello there."


@pytest.mark.anyio
async def test_a_stream_and_a_tool_call(
    client: openai.AsyncAzureOpenAI, fake_azure_openai: FakeAzureOpenAI
) -> None:
    fake_azure_openai.script(
        DEPLOYMENT,
        Stream([Text("Hel"), Text("lo.")]),
        Reply(None, tool_calls=({"name": "lookup", "arguments": {"id": 7}},), finish_reason="tool_calls"),
    )
    chunks = await client.chat.completions.create(model=DEPLOYMENT, messages=MESSAGES, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    assert text == "Hello."
    message = (await client.chat.completions.create(model=DEPLOYMENT, messages=MESSAGES)).choices[0].message
    [call] = message.tool_calls or []
    assert call.function.name == "lookup"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("failure", "exception", "code"),
    [
        pytest.param(
            Fail(status=400, error_code="content_filter"),
            openai.BadRequestError,
            "content_filter",
            id="filter",
        ),
        pytest.param(
            Fail(status=400, error_code="context_length_exceeded"),
            openai.BadRequestError,
            "context_length_exceeded",
            id="context",
        ),
        pytest.param(Fail(status=429, retry_after_ms="4000"), openai.RateLimitError, None, id="429"),
        pytest.param(
            Fail(status=404, error_code="DeploymentNotFound"),
            openai.NotFoundError,
            "DeploymentNotFound",
            id="404",
        ),
    ],
)
async def test_documented_failures(
    client: openai.AsyncAzureOpenAI,
    fake_azure_openai: FakeAzureOpenAI,
    failure: Fail,
    exception: type[openai.APIStatusError],
    code: str | None,
) -> None:
    fake_azure_openai.script(DEPLOYMENT, failure)
    with pytest.raises(exception) as info:
        await client.chat.completions.create(model=DEPLOYMENT, messages=MESSAGES)
    if code is not None:
        assert info.value.code == code
    if code == "content_filter":
        body = info.value.body
        assert isinstance(body, dict)
        assert body["innererror"]["code"] == "ResponsibleAIPolicyViolation"


@pytest.mark.anyio
async def test_a_wrong_key(fake_azure_openai: FakeAzureOpenAI) -> None:
    async with openai.AsyncAzureOpenAI(
        azure_endpoint=fake_azure_openai.endpoint, api_key="wrong", api_version=VERSION, max_retries=0
    ) as sdk:
        with pytest.raises(openai.AuthenticationError):
            await sdk.chat.completions.create(model=DEPLOYMENT, messages=MESSAGES)
