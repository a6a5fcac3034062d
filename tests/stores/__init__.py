"""The stores: what every store shares (memory, SQLite, Redis alike) and what only SQLite or
Redis has."""
