"""Where the store's Redis is, from its URL (`Address`): one server (`redis://`, `rediss://`,
`unix://`), behind Redis Sentinel (`redis+sentinel://`: each new connection first asks the
sentinels where the primary is, and its handshake checks the server's `ROLE`, so a connection
to a replica fails and the next one asks again), or Redis Cluster (`redis+cluster://`: the
seeds the cluster's client first asks for the slots' primaries); the TLS context of a
`rediss` URL; and what a new connection sends first (AUTH, SELECT, ROLE). A URL that cannot be
used raises a `ValueError` naming what is wrong, never the URL (it may carry a password).
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ._protocol import Wire, new_reader, packed

__all__ = ["Address"]


@dataclass(frozen=True, slots=True)
class Address:
    """Where the store's Redis is and how to log in, from its URL:
    `redis://[[username]:password@]host[:port][/db]`, `rediss://...` (TLS) or
    `unix://[[username]:password@]/path/to/socket[?db=n]`; or, behind Redis Sentinel,
    `redis+sentinel://[[username]:password@]host[:port][,host[:port]...]/master-name[/db]`
    (`rediss+sentinel://`: TLS to the sentinels and the primary; the sentinels' port is 26379
    by default); or on Redis Cluster, `redis+cluster://[[username]:password@]host[:port][,...]`
    (`rediss+cluster://`: TLS to every node; the seeds, at most 16, any nodes of the cluster;
    database 0 only). Options, in the query string: `db`, and for TLS `ssl_cert_reqs` (`required`,
    the default; `optional`; `none`), `ssl_ca_certs` (a CA file), `ssl_certfile` and
    `ssl_keyfile` (a client certificate), `ssl_check_hostname` (`true` by default when
    certificates are required); `sentinel_password` (the sentinels' own, when they require
    one; the URL's password is the primary's); and `prefix`, the store's key prefix (see
    `RedisStore`)."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None  # a unix socket
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: ssl.SSLContext | None = None
    prefix: str | None = None
    #: Behind Sentinel: the sentinels, the primary's name among them, and their password.
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    sentinel_password: str | None = None
    #: On Redis Cluster: the seeds (nodes asked for the slots' primaries).
    cluster: tuple[tuple[str, int], ...] = ()

    _OPTIONS = frozenset(
        {
            "db",
            "prefix",
            "ssl_cert_reqs",
            "ssl_ca_certs",
            "ssl_certfile",
            "ssl_keyfile",
            "ssl_check_hostname",
            "sentinel_password",
        }
    )

    @classmethod
    def parse(cls, url: str) -> Address:
        """The address in `url`; a `ValueError` naming what is wrong, never the URL (it may
        carry a password)."""
        scheme = url.split(":", 1)[0].lower()
        if scheme in ("redis+sentinel", "rediss+sentinel"):
            return cls._parse_sentinel(url, scheme)
        if scheme in ("redis+cluster", "rediss+cluster"):
            return cls._parse_cluster(url, scheme)
        try:
            parts = urllib.parse.urlsplit(url)
            query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
            port = parts.port
        except ValueError:
            raise ValueError("invalid Redis URL (expected redis://, rediss:// or unix://)") from None
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("invalid Redis URL (expected redis://, rediss:// or unix://)")
        options = cls._options(query)
        if "sentinel_password" in options:
            raise ValueError("invalid Redis URL: sentinel_password needs redis+sentinel://")
        db_text = options.get("db", "")
        if parts.scheme != "unix" and parts.path.strip("/"):
            db_text = parts.path.strip("/")
        if db_text and not db_text.isdigit():
            raise ValueError("invalid Redis URL: the database must be a number")
        username = urllib.parse.unquote(parts.username) if parts.username else None
        password = urllib.parse.unquote(parts.password) if parts.password else None
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError("invalid Redis URL: unix:// needs the socket's path")
            return cls(
                path=parts.path,
                db=int(db_text or 0),
                username=username,
                password=password,
                prefix=options.get("prefix"),
            )
        tls = _tls_of(parts.scheme, "rediss", options)
        return cls(
            parts.hostname or "localhost",
            port or 6379,
            None,
            int(db_text or 0),
            username,
            password,
            tls,
            options.get("prefix"),
        )

    @classmethod
    def _options(cls, query: dict[str, list[str]]) -> dict[str, str]:
        unknown = sorted(name for name in query if name not in cls._OPTIONS)
        if unknown:
            named = unknown[0] if unknown[0].isidentifier() and len(unknown[0]) <= 40 else "?"
            raise ValueError(
                f"invalid Redis URL: unknown option {named!r} (known: {', '.join(sorted(cls._OPTIONS))})"
            )
        return {name: values[-1] for name, values in query.items()}

    @classmethod
    def _parse_sentinel(cls, url: str, scheme: str) -> Address:
        """`redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/master-name[/db]`."""
        spelling = "redis+sentinel://[[user]:password@]host:port[,host:port...]/master-name[/db]"
        username, password, sentinels, path, query_text = cls._split_hosts(
            url, scheme, spelling, "sentinel", 26379
        )
        names = [urllib.parse.unquote(part) for part in path.split("/") if part]
        if not names or len(names) > 2:
            raise ValueError(f"invalid Redis URL: name the primary ({spelling})")
        master, db_text = names[0], names[1] if len(names) == 2 else ""
        options = cls._options(urllib.parse.parse_qs(query_text, keep_blank_values=True))
        db_text = db_text or options.get("db", "")
        if db_text and not db_text.isdigit():
            raise ValueError("invalid Redis URL: the database must be a number")
        tls = _tls_of(scheme, "rediss+sentinel", options)
        return cls(
            db=int(db_text or 0),
            username=username,
            password=password,
            tls=tls,
            prefix=options.get("prefix"),
            sentinels=tuple(sentinels),
            master=master,
            sentinel_password=options.get("sentinel_password"),
        )

    @classmethod
    def _parse_cluster(cls, url: str, scheme: str) -> Address:
        """`redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0][?options]`."""
        spelling = "redis+cluster://[[user]:password@]host:port[,host:port...][?options]"
        username, password, seeds, path, query_text = cls._split_hosts(url, scheme, spelling, "node", 6379)
        options = cls._options(urllib.parse.parse_qs(query_text, keep_blank_values=True))
        if "sentinel_password" in options:
            raise ValueError("invalid Redis URL: sentinel_password needs redis+sentinel://")
        db_text = path.strip("/") or options.get("db", "")
        if db_text and not db_text.isdigit():
            raise ValueError("invalid Redis URL: the database must be a number")
        if int(db_text or 0) != 0:
            raise ValueError("invalid Redis URL: Redis Cluster has database 0 only")
        tls = _tls_of(scheme, "rediss+cluster", options)
        return cls(
            username=username, password=password, tls=tls, prefix=options.get("prefix"), cluster=tuple(seeds)
        )

    @staticmethod
    def _split_hosts(
        url: str, scheme: str, spelling: str, what: str, default_port: int
    ) -> tuple[str | None, str | None, list[tuple[str, int]], str, str]:
        """A URL of several hosts (`<scheme>://[[user]:password@]host[:port][,...][/path][?query]`):
        its username, password, hosts (at most 16, `what`s), path and query."""
        rest = url[len(scheme) + 3 :] if url[len(scheme) : len(scheme) + 3] == "://" else None
        if rest is None:
            raise ValueError(f"invalid Redis URL: expected {spelling}")
        rest, _, query_text = rest.partition("?")
        hosts_part, _, path = rest.partition("/")
        login, _, hosts_text = hosts_part.rpartition("@")
        username = password = None
        if login:
            user_text, _, password_text = login.partition(":")
            username = urllib.parse.unquote(user_text) or None
            password = urllib.parse.unquote(password_text) if password_text else None
        hosts = []
        for host_text in hosts_text.split(","):
            try:
                parts = urllib.parse.urlsplit(f"//{host_text}")
                host, port = parts.hostname, parts.port or default_port
            except ValueError:
                host = None
            if not host:
                raise ValueError(f"invalid Redis URL: a {what}'s host:port is malformed ({spelling})")
            hosts.append((host, port))
        if len(hosts) > 16:
            raise ValueError(f"invalid Redis URL: at most 16 {what}s")
        return username, password, hosts, path, query_text

    def handshake(self) -> list[bytes]:
        """The commands a new connection starts with (none for a default database without a
        password). Behind Sentinel, `ROLE` too: a server that is not (or no longer) the primary
        fails the connection (`Wire.data_received`), and the next one asks the sentinels."""
        commands = []
        if self.password is not None:
            login = (self.username, self.password) if self.username else (self.password,)
            commands.append(packed("AUTH", *login))
        if self.db:
            commands.append(packed("SELECT", self.db))
        if self.master is not None:
            commands.append(packed("ROLE"))
        return commands

    async def connect(self, wire: Wire, timeout_s: float, node: tuple[str, int] | None = None) -> None:
        """Connect `wire` to the server (on a cluster, to `node`, with the URL's TLS)."""
        loop = wire.loop
        if node is not None:
            await loop.create_connection(lambda: wire, node[0], node[1], ssl=self.tls)
        elif self.path is not None:
            await loop.create_unix_connection(lambda: wire, self.path)
        elif self.master is not None:
            host, port = await self._primary(timeout_s)
            await loop.create_connection(lambda: wire, host, port, ssl=self.tls)
        else:
            await loop.create_connection(lambda: wire, self.host, self.port, ssl=self.tls)

    async def _primary(self, timeout_s: float) -> tuple[str, int]:
        """Where the primary is, as the sentinels say: all asked at once, each given
        `timeout_s`; the first in the URL's order that answered wins. `OSError` when none knows
        (unreachable, or the name unknown to them)."""
        asks = [asyncio.ensure_future(self._ask(host, port)) for host, port in self.sentinels]
        try:
            await asyncio.wait(asks, timeout=timeout_s)
        finally:
            for ask in asks:
                ask.cancel()
        found = None
        for ask in asks:  # (every failure read, so none is reported as never retrieved)
            if ask.done() and not ask.cancelled() and ask.exception() is None and found is None:
                found = ask.result()
        if found is None:
            raise ConnectionRefusedError("no sentinel named the primary")
        return found

    async def _ask(self, host: str, port: int) -> tuple[str, int] | None:
        """One sentinel's answer to `SENTINEL get-master-addr-by-name` (None: it knows no
        such primary)."""
        reader, writer = await asyncio.open_connection(host, port, ssl=self.tls)
        try:
            commands = []
            if self.sentinel_password is not None:
                commands.append(packed("AUTH", self.sentinel_password))
            commands.append(packed("SENTINEL", "get-master-addr-by-name", self.master or ""))
            writer.write(b"".join(commands))
            parser = new_reader()
            replies: list[Any] = []
            while len(replies) < len(commands):
                data = await reader.read(4096)
                if not data:
                    raise ConnectionResetError
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    replies.append(reply)
        finally:
            writer.close()
        answer = replies[-1]
        if not isinstance(answer, list) or len(answer) != 2 or not str(answer[1]).isdigit():
            return None
        return str(answer[0]), int(answer[1])


def _tls_of(scheme: str, secure: str, options: dict[str, str]) -> ssl.SSLContext | None:
    """The TLS context of a URL whose scheme is `scheme` (`secure`: its TLS spelling), from its
    `ssl_*` options; None without TLS, where an `ssl_*` option is an error."""
    if scheme == secure:
        return _tls_context(options)
    if any(name.startswith("ssl_") for name in options):
        raise ValueError(f"invalid Redis URL: ssl_* options need {secure}://")
    return None


def _tls_context(options: dict[str, str]) -> ssl.SSLContext:
    requirement = options.get("ssl_cert_reqs", "required").lower()
    modes = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
    if requirement not in modes:
        raise ValueError("invalid Redis URL: ssl_cert_reqs must be required, optional or none")
    try:
        context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
        if "ssl_certfile" in options:
            context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"invalid Redis URL: its TLS files cannot be loaded ({type(exc).__name__})"
        ) from None
    check = options.get("ssl_check_hostname", "true" if requirement == "required" else "false").lower()
    if check not in ("true", "false"):
        raise ValueError("invalid Redis URL: ssl_check_hostname must be true or false")
    context.check_hostname = check == "true"
    context.verify_mode = modes[requirement]
    return context
