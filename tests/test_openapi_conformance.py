"""Schemathesis fuzzes the example service from its own OpenAPI document, over real HTTP, while
the fake binding cycles through provider failures: no response may contradict the document
(status, body schema, headers, content type), and none may be a 500."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig

from app.main import create_app
from app.settings import Settings
from fixtures import Drop, Fail, FakeBinding, Raw, Reply

from .conftest import LiveServer, no_sleep

OUTCOMES = [
    Reply("A polite reply."),
    Reply({"label": "billing", "confidence": 0.7}),
    Fail(code=3036, status=429),
    Fail(code=3040, status=429),
    Fail(code=5035, status=403),
    Fail(status=429),
    Fail(code=5006, status=200),
    Reply(""),
    Reply({"label": "mail x@example.com", "confidence": 0.9}),
    Raw(502, b"<html>bad gateway</html>"),
    Drop(),
]

fake = FakeBinding()
fake.script("*", *itertools.islice(itertools.cycle(OUTCOMES), 5000))
# A breaker that opens now and then, so circuit_open is answered too.
app = create_app(Settings(breaker_failure_threshold=3, breaker_reset_s=0.05), binding=fake, sleep=no_sleep)
# A schema-valid request may be refused with 422 (documented): an Idempotency-Key that the
# fuzzer sends again with another body (`idempotency_key_reused`).
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "422", "429", "5xx"]
config = SchemathesisConfig.from_dict(
    {"checks": {"positive_data_acceptance": {"expected-statuses": ACCEPTED}}}
)
schema = schemathesis.openapi.from_dict(app.openapi(), config=config)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with LiveServer(app) as server:
        yield server.url


@schema.parametrize()
# Derandomized: the same examples every run, so CI is never red by chance; raise max_examples
# (or drop derandomize) locally to explore further.
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_responses_match_the_documentation(case: schemathesis.Case, base_url: str) -> None:
    # 502 and 503 are this service's documented answers to provider failures, so the generic
    # "no 5xx" check is replaced by: never a 500 (this app's handlers do not crash).
    response = case.call_and_validate(base_url=base_url, excluded_checks=[not_a_server_error])
    assert response.status_code != 500, response.text
