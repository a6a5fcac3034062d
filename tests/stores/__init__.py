"""The stores: what every store shares (memory, SQLite, Redis alike), what only SQLite or Redis
has, and the circuit breaker (its state machine, `guards/stores/_breaker.py`, in every store and
through guarded routes)."""
