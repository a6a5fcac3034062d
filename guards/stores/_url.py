"""`open_store`: a store from a URL, as deployments configure it (`GUARDS_STORE`)."""

from __future__ import annotations

from urllib.parse import urlsplit

from ..contracts._clock import Clock
from ..contracts._errors import ConfigurationError
from ._base import Store
from ._memory import MemoryStore

__all__ = ["open_store"]


def open_store(url: str, *, clock: Clock | None = None, timeout_s: float = 0.1) -> Store:
    """Open the store a URL names:

    - `memory://`: this process only (one uvicorn worker);
    - `sqlite:///relative/path.db`, `sqlite:////absolute/path.db` (SQLAlchemy's spelling): the
      workers of one machine;
    - `redis://[:password@]host:port/db` or `rediss://...`: every worker of every machine
      (`?prefix=app:` starts every key of the store with `app:`, default `guards:`);
    - `redis+sentinel://[:password@]host:port[,host:port...]/master-name[/db]` or
      `rediss+sentinel://...`: the same, behind Redis Sentinel (the primary found, and followed
      across a failover, by asking the sentinels);
    - `redis+cluster://[:password@]host:port[,host:port...]` or `rediss+cluster://...`: the
      same, on Redis Cluster (the nodes named are where the client first learns the cluster).

    `timeout_s` bounds each operation of a shared store. Raises `ConfigurationError` for a URL
    it cannot use; the message never repeats the URL (it may hold a password).
    """
    scheme = urlsplit(url).scheme.lower()
    if scheme == "memory":
        return MemoryStore(clock=clock)
    if scheme == "sqlite":
        if not url.startswith("sqlite:///") or len(url) == len("sqlite:///"):
            raise ConfigurationError(
                "a SQLite store URL reads sqlite:///relative.db or sqlite:////absolute.db"
            )
        from ._sqlite import SQLiteStore  # sqlite3, only when a SQLite store is asked for

        return SQLiteStore(url[len("sqlite:///") :], clock=clock, timeout_s=timeout_s)
    if scheme in ("redis", "rediss", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster"):
        from ._redis import RedisStore  # the Redis client, only when a Redis store is asked for

        return RedisStore(url, clock=clock, timeout_s=timeout_s)
    raise ConfigurationError(
        f"unknown store scheme {scheme!r}: use memory://, sqlite:///path, redis://host:port/db "
        "redis+sentinel://host:port,.../master-name or redis+cluster://host:port,..."
    )
