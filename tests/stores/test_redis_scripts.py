"""The Redis store's Lua is in `.lua` files shipped in the package, none left as a Python string:
each compiles in Redis' own Lua (5.1, the dialect that runs it: `SCRIPT LOAD` refuses a script
that does not parse), and the script the store loads and calls is the file's, byte for byte
(its SHA1)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
import redis

import guards
from fixtures.redis_server import RedisServer
from guards.stores import RedisStore

PACKAGE = Path(guards.__file__).parent
LUA = PACKAGE / "stores" / "_redis" / "lua"


def lua_files() -> list[Path]:
    files = sorted(LUA.glob("*.lua"))
    assert files  # the check is real
    return files


def test_every_lua_file_compiles_in_redis(admin: redis.Redis) -> None:
    for path in lua_files():
        assert admin.script_load(path.read_text()) == hashlib.sha1(path.read_bytes()).hexdigest()
    broken = lua_files()[0].read_text() + "\nend\n"  # an `end` too many
    with pytest.raises(redis.ResponseError, match="compiling script"):
        admin.script_load(broken)


def test_the_store_loads_and_calls_the_lua_files_script() -> None:
    """On a server that never saw it, the store's first operation loads its script: the one
    of `lua/store.lua`, under the SHA the store's calls name."""
    script = LUA / "store.lua"
    sha = hashlib.sha1(script.read_bytes()).hexdigest()
    with RedisServer() as server, redis.Redis.from_url(server.url) as admin:
        assert admin.script_exists(sha) == [False]
        store = RedisStore(server.url)

        async def charge() -> bool:
            try:
                return (await store.charge_budget("scripted", per_minute=None, per_day=1)).allowed
            finally:
                await store.aclose()

        assert asyncio.run(charge())
        assert admin.script_exists(sha) == [True]


def test_no_python_module_of_the_package_holds_lua() -> None:
    """Lua lives in `.lua` files (read, linted and diffed as Lua), not in Python strings."""
    holding = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "redis.call(" in path.read_text() or "KEYS[" in path.read_text()
    )
    assert holding == []
