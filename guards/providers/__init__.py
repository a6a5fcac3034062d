"""Adapters from the binding protocol to real providers."""

from ._workers_ai import WorkersAI, parse_workers_ai_response

__all__ = ["WorkersAI", "parse_workers_ai_response"]
