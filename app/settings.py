"""Settings from the environment. Errors name the variable to fix, never echo its value."""

from __future__ import annotations

import json
import os
import re
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

OPENAI_BASE_URL = "https://api.openai.com/v1"
ANTHROPIC_BASE_URL = "https://api.anthropic.com"
GEMINI_BASE_URL = "https://generativelanguage.googleapis.com"
#: Provider names the example app knows, usable as AI_PROVIDER and as AI_FALLBACK_MODELS prefixes.
PROVIDERS = ("fake", "workers-ai", "openai", "anthropic", "gemini", "bedrock", "azure-openai")
Provider = Literal["fake", "workers-ai", "openai", "anthropic", "gemini", "bedrock", "azure-openai"]
#: A browser origin: scheme, host and optional port, nothing after.
_ORIGIN = re.compile(r"https?://[^/\s,]+")
#: An operator token: long enough not to be guessed, and what a bearer token may hold (RFC 6750).
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]{16,256}={0,2}")
#: The routing hints effort routing uses, and their targets unless AI_LOCAL_MODEL,
#: AI_CLOUD_MODEL or AI_HINTS say otherwise.
LOCAL_HINT, CLOUD_HINT = "local", "cloud"
DEFAULT_LOCAL_MODEL = "@cf/meta/llama-3.1-8b-instruct"
DEFAULT_CLOUD_MODEL = "@cf/meta/llama-3.3-70b-instruct-fp8-fast"


#: A deployment's name in AI_DEPLOYMENTS, and its weight.
_DEPLOYMENT = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,31}")
_WEIGHT = re.compile(r"[0-9]{1,6}(\.[0-9]{1,6})?")


class SettingsError(RuntimeError):
    """The environment does not describe a service that can start."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore")

    ai_provider: Provider = "fake"
    cloudflare_account_id: str = ""
    cloudflare_api_token: SecretStr = SecretStr("")
    cloudflare_api_base: str = "https://api.cloudflare.com/client/v4"
    openai_base_url: str = OPENAI_BASE_URL
    openai_api_key: SecretStr = SecretStr("")
    anthropic_api_key: SecretStr = SecretStr("")
    #: The adapter adds `/v1/messages`.
    anthropic_base_url: str = ANTHROPIC_BASE_URL
    gemini_api_key: SecretStr = SecretStr("")
    #: The adapter adds `/v1beta/models/...`.
    gemini_base_url: str = GEMINI_BASE_URL
    #: Bedrock's region; its credentials come from the standard AWS chain (environment,
    #: profile, role, or `AWS_BEARER_TOKEN_BEDROCK`), read by the adapter.
    aws_region: str = ""
    #: Bedrock's runtime endpoint (unset: `https://bedrock-runtime.{region}.amazonaws.com`).
    aws_endpoint_url_bedrock_runtime: str = ""
    #: An Azure OpenAI resource (`https://<resource>.openai.azure.com`) and its key; with
    #: OPENAI_API_VERSION the deployment endpoint, else the v1 endpoint.
    azure_openai_endpoint: str = ""
    azure_openai_api_key: SecretStr = SecretStr("")
    openai_api_version: str = ""
    ai_model: str = Field(default="@cf/meta/llama-3.3-70b-instruct-fp8-fast", min_length=1)
    #: The ordered fallback chain, comma-separated; an entry may name its provider
    #: (`openai:gpt-4o-mini`, `workers-ai:@cf/...`, `fake:any`), else it is an AI_PROVIDER model.
    ai_fallback_models: str = ""
    ai_attribution: Literal["off", "redacted", "detailed"] = "detailed"
    ai_timeout_s: float = Field(default=8.0, gt=0)
    #: How long each model of the chains gets to start answering (its first streamed word, or
    #: a whole answer's first byte) before the next model is tried; unset: the deadline alone.
    ai_first_output_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    #: A call (a stream before its first output) with no answer after this long asks the
    #: chain's next model too, the first answer winning; unset: never (see docs/hedging.md).
    ai_hedge_after_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    #: What an answer the output guard rejects does on /draft-reply, /summary and /report:
    #: `fallback` ends the request, `next_model` moves on along the chain, `reask` asks the
    #: same model once more with the problems, then moves on.
    ai_on_rejected: Literal["fallback", "next_model", "reask"] = "fallback"
    #: A stream with no complete event for this long fails as stalled (the adapters' idle limit).
    ai_stream_idle_timeout_s: float = Field(default=30.0, gt=0)
    #: A streamed answer ends with the `error` event this long after the request began...
    ai_stream_max_s: float = Field(default=300.0, gt=0)
    #: ...or before its output passes this many characters.
    ai_stream_max_chars: int = Field(default=1 << 20, ge=1)
    daily_call_limit: int = Field(default=20, ge=1)
    rate_limit_per_minute: int = Field(default=60, ge=1)
    #: Tokens per user on /summary (unset: no token limit): in any 60 seconds, per UTC day.
    tokens_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_day: int | None = Field(default=None, ge=1)
    #: Calls per tenant (`x-tenant-id`) per UTC day on /summary, admitted with the user's budget.
    tenant_daily_call_limit: int | None = Field(default=None, ge=1)
    #: Requests per UTC minute on /summary shared fairly by the tenants (`x-tenant-id`): the
    #: model's upstream limit (unset: none).
    fair_share_per_minute: int | None = Field(default=None, ge=1)
    #: Calls per user per UTC calendar month, on /summary and /report together.
    monthly_call_limit: int | None = Field(default=None, ge=1)
    breaker_failure_threshold: int = Field(default=5, ge=1)
    breaker_reset_s: float = Field(default=30.0, gt=0)
    #: Count failures within this many seconds instead of consecutive ones (unset: consecutive).
    breaker_window_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    #: A call slower than this counts as a failure (needs BREAKER_WINDOW_S; unset: off)...
    breaker_slow_call_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    #: ...once the window holds this many calls.
    breaker_minimum_calls: int = Field(default=10, ge=1, le=1000)
    #: After a failed probe, the breaker reopens for this long (unset: 5 s, at most BREAKER_RESET_S).
    breaker_probe_interval_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    retry_after_s: float = Field(default=30.0, gt=0)
    #: Guarded requests one worker serves at once before it sheds /draft-reply/stream (unset: no limit).
    max_in_flight: int | None = Field(default=None, ge=1)
    guards_store: str = "memory://"
    guards_store_failure: Literal["open", "closed"] | None = None
    #: Origins whose pages may call the app from a browser (comma-separated; `*` for any);
    #: empty: no CORS headers at all.
    cors_allow_origins: str = ""
    #: Routing hints, comma-separated `name=entry` (`fast=openai:gpt-4o-mini`), which AI_MODEL
    #: and AI_FALLBACK_MODELS may name as `hint:name`.
    ai_hints: str = ""
    #: `auto`: /draft-reply and /draft-reply/stream route each request by its estimated effort
    #: (simple and standard to the `local` hint, complex to the `cloud` hint).
    ai_effort: Literal["off", "auto"] = "off"
    #: The targets of the `local` and `cloud` hints (may carry a provider prefix).
    ai_local_model: str = ""
    ai_cloud_model: str = ""
    #: How long /summary serves the last good summary of the same text when the model fails.
    last_good_max_age_s: float = Field(default=600.0, gt=0)
    #: Models' context windows in tokens, a JSON object (`{"@cf/meta/llama-3.1-8b-instruct":
    #: 8192}`): a model whose window cannot hold a request is skipped without a call. A key
    #: names a model as AI_MODEL does (for every provider the app uses), or as a chain entry
    #: with its provider (`openai:gpt-4o-mini`, for that provider only).
    ai_context_windows: str = ""
    #: `on`: a provider's content filter moves on to the chain's next model of another provider;
    #: `off`: the request ends with `moderation_blocked`.
    ai_content_filter_fallback: Literal["off", "on"] = "off"
    #: Deployments of AI_MODEL that /draft-reply and /draft-reply/stream balance, comma-separated
    #: `name=weight` (`east=3,west=1`): each a binding of AI_PROVIDER of its own (its own
    #: connections, breaker and cooldown); empty: AI_MODEL alone. Not with AI_EFFORT=auto.
    ai_deployments: str = ""
    #: How a deployment is chosen: `weighted` (random, by weight), `least_busy`, `lowest_latency`.
    ai_deployment_strategy: Literal["weighted", "least_busy", "lowest_latency"] = "weighted"
    #: Requests per minute each deployment takes, across workers (unset: no limit).
    ai_deployment_rpm: int | None = Field(default=None, ge=1)
    #: The operator token of `GET /status` (`Authorization: Bearer <token>`); empty: the page is open.
    status_token: SecretStr = SecretStr("")
    #: How often the status page reloads itself in a browser (seconds).
    status_refresh_s: float = Field(default=5.0, ge=1)

    @property
    def fallback_models(self) -> list[str]:
        return [entry.strip() for entry in self.ai_fallback_models.split(",") if entry.strip()]

    @property
    def allowed_origins(self) -> list[str]:
        return [entry.strip() for entry in self.cors_allow_origins.split(",") if entry.strip()]

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins(cls, value: str) -> str:
        for entry in (e.strip() for e in value.split(",")):
            if entry and entry != "*" and not _ORIGIN.fullmatch(entry):
                raise ValueError("each entry must be an origin such as https://app.example.com, or *")
        return value

    @field_validator("ai_context_windows")
    @classmethod
    def _context_windows(cls, value: str) -> str:
        if not value.strip():
            return value
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or not all(
            isinstance(key, str)
            and key.strip()
            and isinstance(tokens, int)
            and not isinstance(tokens, bool)
            and tokens > 0
            for key, tokens in parsed.items()
        ):
            raise ValueError(
                'must be a JSON object of model name to a positive number of tokens, e.g. {"@cf/meta/llama-3.1-8b-instruct": 8192}'
            )
        return value

    @property
    def context_windows(self) -> dict[str, int]:
        """AI_CONTEXT_WINDOWS as model keys: a plain model name for the main provider and for
        each other provider the app uses (`provider:name`), unless given with its provider."""
        given: dict[str, int] = json.loads(self.ai_context_windows) if self.ai_context_windows.strip() else {}
        windows: dict[str, int] = {}
        for name, tokens in given.items():
            if name.partition(":")[0] in PROVIDERS:
                continue  # with its provider: below, over a plain name's
            windows[name] = tokens
            for provider in self.providers_used():
                windows[f"{provider}:{name}"] = tokens
        windows.update(
            (name, tokens) for name, tokens in given.items() if name.partition(":")[0] in PROVIDERS
        )
        return windows

    @field_validator("ai_deployments")
    @classmethod
    def _deployments(cls, value: str) -> str:
        names = []
        for entry in (e.strip() for e in value.split(",")):
            name, _, weight = entry.partition("=")
            if not entry:
                continue
            if (
                not _DEPLOYMENT.fullmatch(name.strip())
                or not _WEIGHT.fullmatch(weight.strip())
                or not float(weight)
            ):
                raise ValueError(
                    "must be comma-separated name=weight, each name a short token, e.g. east=3,west=1"
                )
            names.append(name.strip())
        if len(set(names)) != len(names):
            raise ValueError("must name each deployment once")
        return value

    @property
    def deployments(self) -> dict[str, float]:
        """AI_DEPLOYMENTS: each deployment's name and weight, in order."""
        return {
            name.strip(): float(weight)
            for name, _, weight in (e.strip().partition("=") for e in self.ai_deployments.split(","))
            if name.strip()
        }

    @field_validator("status_token")
    @classmethod
    def _status_token(cls, value: SecretStr) -> SecretStr:
        token = value.get_secret_value()
        if token and not _TOKEN.fullmatch(token):
            raise ValueError(
                "must be 16 to 256 characters of letters, digits and -._~+/= (e.g. `openssl rand -hex 32`)"
            )
        return value

    @property
    def hints(self) -> dict[str, str]:
        """Every routing hint: `local` and `cloud` (AI_LOCAL_MODEL, AI_CLOUD_MODEL, else
        AI_HINTS, else the defaults), and AI_HINTS' own."""
        hints = {LOCAL_HINT: DEFAULT_LOCAL_MODEL, CLOUD_HINT: DEFAULT_CLOUD_MODEL}
        for entry in self.ai_hints.split(","):
            if entry.strip():
                name, _, target = entry.partition("=")
                hints[name.strip()] = target.strip()
        if self.ai_local_model.strip():
            hints[LOCAL_HINT] = self.ai_local_model.strip()
        if self.ai_cloud_model.strip():
            hints[CLOUD_HINT] = self.ai_cloud_model.strip()
        return hints

    def providers_used(self) -> set[str]:
        """AI_PROVIDER and every provider an AI_FALLBACK_MODELS entry or a hint names."""
        return {self.ai_provider} | set(self._named_providers())

    def _named_providers(self) -> dict[str, str]:
        """Each provider a chain entry or a hint names, with the variable that names it first."""
        named: dict[str, str] = {}
        entries = [(entry, "AI_FALLBACK_MODELS") for entry in self.fallback_models]
        hints = self.hints
        for name, variable in ((LOCAL_HINT, "AI_LOCAL_MODEL"), (CLOUD_HINT, "AI_CLOUD_MODEL")):
            if hints[name] == getattr(self, variable.lower()).strip():
                entries.append((hints[name], variable))
        entries += [(target, "AI_HINTS") for target in hints.values()]
        for entry, variable in entries:
            prefix = entry.partition(":")[0].strip() if ":" in entry else ""
            if prefix in PROVIDERS:
                named.setdefault(prefix, variable)
        return named

    @model_validator(mode="after")
    def _hints(self) -> Settings:
        for entry in self.ai_hints.split(","):
            name, equals, target = entry.partition("=")
            if entry.strip() and not (equals and name.strip() and target.strip()):
                raise ValueError("AI_HINTS: each entry is name=model (comma-separated)")
        return self

    @model_validator(mode="after")
    def _breaker(self) -> Settings:
        if self.breaker_slow_call_s is not None and self.breaker_window_s is None:
            raise ValueError("BREAKER_SLOW_CALL_S needs BREAKER_WINDOW_S (the window slow calls count in)")
        if self.breaker_probe_interval_s is not None and self.breaker_probe_interval_s > self.breaker_reset_s:
            raise ValueError("BREAKER_PROBE_INTERVAL_S must be at most BREAKER_RESET_S")
        return self

    @model_validator(mode="after")
    def _credentials(self) -> Settings:
        # A chain that names a provider without its credentials fails start-up: quietly
        # dropping the entry would change the route.
        needs = {
            "workers-ai": (
                ("CLOUDFLARE_ACCOUNT_ID", self.cloudflare_account_id),
                ("CLOUDFLARE_API_TOKEN", self.cloudflare_api_token.get_secret_value()),
            ),
            "openai": (("OPENAI_API_KEY", self.openai_api_key.get_secret_value()),),
            "anthropic": (("ANTHROPIC_API_KEY", self.anthropic_api_key.get_secret_value()),),
            "gemini": (("GEMINI_API_KEY", self.gemini_api_key.get_secret_value()),),
            "bedrock": (("AWS_REGION", self.aws_region),),
            "azure-openai": (
                ("AZURE_OPENAI_ENDPOINT", self.azure_openai_endpoint),
                ("AZURE_OPENAI_API_KEY", self.azure_openai_api_key.get_secret_value()),
            ),
        }
        named = self._named_providers()
        for provider in sorted(self.providers_used()):
            missing = [name for name, value in needs.get(provider, ()) if not value]
            # A local OpenAI-compatible server (Ollama, llama.cpp) needs no key.
            if provider == "openai" and self.openai_base_url != OPENAI_BASE_URL:
                missing = []
            where = "AI_PROVIDER" if provider == self.ai_provider else named[provider]
            if missing:
                raise ValueError(f"{where} uses {provider}, which needs {' and '.join(missing)} to be set")
            problem = aws_credentials_problem() if provider == "bedrock" else None
            if problem:
                raise ValueError(f"{where} uses bedrock, which {problem}")
        return self


def aws_credentials_problem() -> str | None:
    """What keeps Bedrock from signing its requests, or None: a Bedrock API key is set, or the
    standard AWS chain resolves (environment, shared files, SSO, container or instance role:
    the chain the adapter reads). Never a value."""
    if os.environ.get("AWS_BEARER_TOKEN_BEDROCK"):
        return None
    try:
        import botocore.session
    except ModuleNotFoundError:
        return "needs botocore: pip install 'route-guards[bedrock]'"
    try:
        credentials = botocore.session.Session().get_credentials()
    except Exception:  # a profile that does not exist, a broken config file: none resolve
        credentials = None
    if credentials is None:
        return (
            "found no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, a role, or AWS_BEARER_TOKEN_BEDROCK"
        )
    return None


def load_settings() -> Settings:
    """Read the environment; raise `SettingsError` naming each bad variable (no values)."""
    try:
        return Settings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_input=False, include_url=False):
            name = "_".join(str(part) for part in error["loc"]).upper()
            problems.append(f"{name}: {error['msg']}" if name else error["msg"])
        raise SettingsError("invalid settings: " + "; ".join(problems)) from None
