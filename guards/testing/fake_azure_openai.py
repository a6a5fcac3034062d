"""A fake Azure OpenAI resource on a loopback port: `FakeOpenAI`'s chat completions (the same
scripted outcomes on OpenAI's wire, Azure's content-filter error included) at Azure's
addresses and with Azure's credentials."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, unquote

from ._server import Wire
from .fake_openai import FakeOpenAI
from .script import Chooser, Outcome

__all__ = ["FakeAzureOpenAI"]

_DEPLOYMENT = re.compile(r"^/openai/deployments/(?P<deployment>[^/?]+)/chat/completions\?(?P<query>.*)$")
_V1 = "/openai/v1/chat/completions"
_JSON = {"content-type": "application/json", "apim-request-id": "00000000-0000-0000-0000-000000000000"}


def _azure_error(status: int, code: str, message: str) -> Wire:
    return status, _JSON, json.dumps({"error": {"code": code, "message": message}}).encode()


class FakeAzureOpenAI(FakeOpenAI):
    """`with FakeAzureOpenAI() as server:` an Azure OpenAI resource at `server.endpoint` (the
    adapter's and the SDK's `azure_endpoint`).

    It serves the v1 endpoint, `POST {endpoint}/openai/v1/chat/completions` (the deployment in
    the body's `model`; `server.base_url` is `{endpoint}/openai/v1`), and the deployment
    endpoint, `POST {endpoint}/openai/deployments/{deployment}/chat/completions?api-version=...`
    (the deployment is the call's model; without an `api-version` the answer is Azure's 404).
    A request needs the `api-key` header `api_key`, or `Authorization: Bearer` with `token` (an
    Entra ID token) or `api_key` (as the v1 endpoint takes a key), else Azure's 401. Script and read calls as on `FakeOpenAI`; an unknown deployment
    is `Fail(status=404, error_code="DeploymentNotFound")`.
    """

    thread_name = "fake-azure-openai"

    def __init__(
        self,
        default: Outcome | Chooser | None = None,
        *,
        api_key: str | None = "test-azure-key",
        token: str | None = "test-entra-token",
    ) -> None:
        super().__init__(default, api_key=api_key)
        self.token = token

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.endpoint}/openai/v1"

    def route(self, method: str, path: str, headers: Mapping[str, str], inputs: Any) -> str | Wire:
        deployment = _DEPLOYMENT.match(path)
        if method != "POST" or (path != _V1 and deployment is None):
            return _azure_error(404, "404", "Resource not found")
        if deployment is not None and not parse_qs(deployment["query"]).get("api-version"):
            return _azure_error(404, "404", "Resource not found")
        refused = self.authorize(headers)
        if refused is not None:
            return refused
        if deployment is not None:
            return unquote(deployment["deployment"])
        model = inputs.get("model") if isinstance(inputs, dict) else None
        if not isinstance(model, str) or not model:
            return _azure_error(400, "BadRequest", "Missing required parameter: 'model'.")
        return model

    def authorize(self, headers: Mapping[str, str]) -> Wire | None:
        key = headers.get("api-key")
        bearer = headers.get("authorization")
        accepted = {f"Bearer {t}" for t in (self.token, self.api_key) if t is not None}
        if (key is not None and key == self.api_key) or bearer in accepted:
            return None
        return _azure_error(
            401,
            "401",
            "Access denied due to invalid subscription key or wrong API endpoint. Make sure to "
            "provide a valid key for an active subscription and use a correct regional API "
            "endpoint for your resource.",
        )
