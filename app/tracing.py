"""Traces for the example app, turned on by OpenTelemetry's own `OTEL_TRACES_EXPORTER`.

`console` prints each span on stdout (a quick look); `otlp` sends them to a collector over
OTLP (HTTP/protobuf unless `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`
says `grpc`, whose exporter is not installed by default); several, comma-separated, send to
each. Everything else is the SDK's own settings, read by the SDK: `OTEL_EXPORTER_OTLP_ENDPOINT`
(default `http://localhost:4318`), `OTEL_SERVICE_NAME` (default here: `guards-example`),
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`. Unset (or `none`): no tracing,
and nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from .settings import SettingsError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = ["tracer_provider_from_env"]

SERVICE_NAME = "guards-example"
#: The OTLP exporters' entry points (the SDK's names) by `OTEL_EXPORTER_OTLP_PROTOCOL`.
_OTLP = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The span exporters `OTEL_TRACES_EXPORTER` asks for, as entry points of the SDK's group
    `opentelemetry_traces_exporter` (empty: tracing off)."""
    names = [name.strip() for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    if names in ([], ["none"]):
        return []
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if "otlp" in names and protocol not in _OTLP:
        raise SettingsError("OTEL_EXPORTER_OTLP_PROTOCOL must be http/protobuf or grpc")
    return [_OTLP[protocol] if name == "otlp" else name for name in names]


def tracer_provider_from_env(environ: Mapping[str, str] = os.environ) -> TracerProvider | None:
    """An SDK `TracerProvider` exporting through the exporters `OTEL_TRACES_EXPORTER` names
    (batched, as the SDK does), or None when it names none. Raises `SettingsError` naming the
    variable for an exporter that is not installed."""
    names = exporter_names(environ)
    if not names:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)  # OTEL_TRACES_SAMPLER
    for name in names:
        found = entry_points(group="opentelemetry_traces_exporter", name=name)
        if not found:
            raise SettingsError(
                f"OTEL_TRACES_EXPORTER: no span exporter {name!r} is installed "
                "(console and otlp over http/protobuf come with the app)"
            )
        exporter = next(iter(found)).load()()  # each reads its own OTEL_EXPORTER_* settings
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
