"""What the operator sees: the JSON log lines and the writer that never blocks the event loop,
the Prometheus metrics, and the usage ledger. Imports only `guards.contracts`.
"""

__all__: list[str] = []
