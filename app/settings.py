"""Settings from the environment. Errors name the variable to fix, never echo its value."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

OPENAI_BASE_URL = "https://api.openai.com/v1"
#: Provider names the example app knows, usable as AI_PROVIDER and as AI_FALLBACK_MODELS prefixes.
PROVIDERS = ("fake", "workers-ai", "openai")


class SettingsError(RuntimeError):
    """The environment does not describe a service that can start."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore")

    ai_provider: Literal["fake", "workers-ai", "openai"] = "fake"
    cloudflare_account_id: str = ""
    cloudflare_api_token: SecretStr = SecretStr("")
    cloudflare_api_base: str = "https://api.cloudflare.com/client/v4"
    openai_base_url: str = OPENAI_BASE_URL
    openai_api_key: SecretStr = SecretStr("")
    ai_model: str = Field(default="@cf/meta/llama-3.3-70b-instruct-fp8-fast", min_length=1)
    #: The ordered fallback chain, comma-separated; an entry may name its provider
    #: (`openai:gpt-4o-mini`, `workers-ai:@cf/...`, `fake:any`), else it is an AI_PROVIDER model.
    ai_fallback_models: str = ""
    ai_attribution: Literal["off", "redacted", "detailed"] = "detailed"
    ai_timeout_s: float = Field(default=8.0, gt=0)
    #: A stream with no complete event for this long fails as stalled (the adapters' idle limit).
    ai_stream_idle_timeout_s: float = Field(default=30.0, gt=0)
    #: A streamed answer ends with the `error` event this long after the request began...
    ai_stream_max_s: float = Field(default=300.0, gt=0)
    #: ...or before its output passes this many characters.
    ai_stream_max_chars: int = Field(default=1 << 20, ge=1)
    daily_call_limit: int = Field(default=20, ge=1)
    rate_limit_per_minute: int = Field(default=60, ge=1)
    breaker_failure_threshold: int = Field(default=5, ge=1)
    breaker_reset_s: float = Field(default=30.0, gt=0)
    retry_after_s: float = Field(default=30.0, gt=0)
    #: Guarded requests one worker serves at once before it sheds /draft-reply/stream (unset: no limit).
    max_in_flight: int | None = Field(default=None, ge=1)
    guards_store: str = "memory://"
    guards_store_failure: Literal["open", "closed"] | None = None

    @property
    def fallback_models(self) -> list[str]:
        return [entry.strip() for entry in self.ai_fallback_models.split(",") if entry.strip()]

    def providers_used(self) -> set[str]:
        """AI_PROVIDER and every provider an AI_FALLBACK_MODELS entry names."""
        named = {entry.partition(":")[0] for entry in self.fallback_models if ":" in entry}
        return {self.ai_provider} | (named & set(PROVIDERS))

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
        }
        for provider in sorted(self.providers_used()):
            missing = [name for name, value in needs.get(provider, ()) if not value]
            # A local OpenAI-compatible server (Ollama, llama.cpp) needs no key.
            if provider == "openai" and self.openai_base_url != OPENAI_BASE_URL:
                missing = []
            if missing:
                where = "AI_PROVIDER" if provider == self.ai_provider else "AI_FALLBACK_MODELS"
                raise ValueError(f"{where} uses {provider}, which needs {' and '.join(missing)} to be set")
        return self


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
