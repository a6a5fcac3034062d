"""Settings from the environment. Errors name the variable to fix, never echo its value."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class SettingsError(RuntimeError):
    """The environment does not describe a service that can start."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore")

    ai_provider: Literal["fake", "workers-ai"] = "fake"
    cloudflare_account_id: str = ""
    cloudflare_api_token: SecretStr = SecretStr("")
    cloudflare_api_base: str = "https://api.cloudflare.com/client/v4"
    ai_model: str = Field(default="@cf/meta/llama-3.3-70b-instruct-fp8-fast", min_length=1)
    ai_timeout_s: float = Field(default=8.0, gt=0)
    daily_call_limit: int = Field(default=20, ge=1)
    rate_limit_per_minute: int = Field(default=60, ge=1)
    breaker_failure_threshold: int = Field(default=5, ge=1)
    breaker_reset_s: float = Field(default=30.0, gt=0)
    retry_after_s: float = Field(default=30.0, gt=0)
    guards_store: str = "memory://"
    guards_store_failure: Literal["open", "closed"] | None = None

    @model_validator(mode="after")
    def _credentials(self) -> Settings:
        if self.ai_provider == "workers-ai":
            missing = [
                name
                for name, value in (
                    ("CLOUDFLARE_ACCOUNT_ID", self.cloudflare_account_id),
                    ("CLOUDFLARE_API_TOKEN", self.cloudflare_api_token.get_secret_value()),
                )
                if not value
            ]
            if missing:
                raise ValueError(f"AI_PROVIDER=workers-ai needs {' and '.join(missing)} to be set")
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
