"""The Redis store (`RedisStore`), in parts: `_store` (the store's operations), `_keys` (its
keys), `_scripts` and `lua/store.lua` (the Lua script that does each operation on the server),
`_planner` (a step's script arguments and replies), `_slots` (Redis Cluster: operations split
per hash slot; the cluster's client is `guards.stores._cluster`), `_connection` (one connection
per event loop), `_protocol` (the wire to one server), `_address` (the URL: one server,
Sentinel, Cluster, TLS) and `_checks` (the server's settings, evictions, error replies).
Imported on first use (`guards.stores.RedisStore`): hiredis, the extra `[redis]`, is loaded
only by an app that uses Redis.
"""

from ._store import RedisStore

__all__ = ["RedisStore"]
