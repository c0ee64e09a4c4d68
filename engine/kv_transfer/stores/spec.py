"""``--kv-store``: the tiers a spec names, made in lookup order."""
from __future__ import annotations

import functools

from engine.config import parse_size
from engine.kv_transfer.secret import KVSecret
from engine.kv_transfer.stores.base import (
    DEFAULT_REDIS_TTL_S, REDIS_SCHEMES, ChunkFormat, KVStore, redact, split_store_spec,
)
from engine.kv_transfer.stores.cpu import CPUStore
from engine.kv_transfer.stores.disk import DiskStore


def parse_store_spec(spec: str, fmt: ChunkFormat, redis_ttl_s: int = DEFAULT_REDIS_TTL_S,
                     secret: KVSecret | None = None) -> list[KVStore]:
    """``cpu:4GiB,disk:/path:20GiB,redis://host:6379/0`` -> stores in lookup order. With a secret,
    disk and Redis entries are authenticated (serde.py). The whole spec is checked before any
    store is made: a bad one creates no directory and opens no connection."""
    makers: dict[str, functools.partial[KVStore]] = {}  # tier name -> its constructor, in lookup order
    for part in split_store_spec(spec):
        if part.startswith(REDIS_SCHEMES):
            from engine.kv_transfer.stores.redis import RedisStore  # redis-py: ~0.2 s, imported only when used
            name, maker = "redis", functools.partial(RedisStore, part, fmt, ttl_s=redis_ttl_s, secret=secret)
        elif part.startswith("cpu:"):
            name, maker = "cpu", functools.partial(CPUStore, parse_size(part[4:]), fmt)
        elif part.startswith("disk:"):
            path, sep, size = part[5:].rpartition(":")
            if not sep or not path:
                # (never echoed: it may be a piece of a Redis password that held a comma)
                raise ValueError("disk tier needs a path and a size, e.g. disk:/var/cache/kv:20GiB")
            name, maker = "disk", functools.partial(DiskStore, path, parse_size(size), fmt, secret=secret)
        else:
            # Only the name: a mistyped Redis URL ("redis:/user:pass@host") must not show its password.
            raise ValueError(f"unknown KV store tier {part.partition(':')[0]!r}; expected cpu:SIZE, disk:PATH:SIZE "
                             "or redis://...")
        if name in makers:
            raise ValueError(f"each tier may appear once in --kv-store, got {redact(spec)!r}")
        makers[name] = maker
    if not makers:
        raise ValueError("--kv-store names no tier")
    return [make() for make in makers.values()]
