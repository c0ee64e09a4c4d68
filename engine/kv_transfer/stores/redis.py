"""Redis tier: chunks as self-describing payloads under ``engine-kv:<namespace>:<key>`` with a
TTL. Shared by every engine pointed at the same server, so one instance's prefill is another's
prefix hit. Redis being down never blocks or fails a request: each operation has a short
timeout, the tier turns itself off with one warning, and a background probe turns it back on
when the server answers again; while it is off every call returns at once.

The URL is redis-py's (``Redis.from_url``): ``redis://[[user]:password@]host:port/db`` (a
password alone, or an ACL user and password; percent-encode ``/ ? # % @`` and spaces in them),
``rediss://`` for TLS with query arguments ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_cert_reqs`` (``required``, the default, or ``none``) and ``ssl_check_hostname``, and
``unix:///path/redis.sock?db=0``. A wrong password or an untrusted certificate is a server
that does not answer: the tier is off and retried. The password is masked in every log line
and error (``base.redact``)."""
from __future__ import annotations

import logging
import re
import threading
import time
from urllib.parse import urlsplit

import redis
import torch

from engine.kv_transfer import serde
from engine.kv_transfer.secret import KVSecret
from engine.kv_transfer.stores.base import ChunkFormat, KVStore, redact

logger = logging.getLogger("engine.kv_store")
TIMEOUT_S = 1.0
RETRY_S = 2.0


class RedisStore(KVStore):
    name = "redis"

    def __init__(self, url: str, fmt: ChunkFormat, ttl_s: int | None = None, secret: KVSecret | None = None) -> None:
        super().__init__(fmt)
        self.url = redact(url)  # for logs: the real URL lives only in the client's connection settings
        self.ttl_s = ttl_s
        self.secret = secret
        self.prefix = f"engine-kv:{fmt.namespace}:"
        # A URL that does not parse is never shown, even redacted: a password with an unencoded
        # / ? # or , is exactly what makes it not parse, and a piece of it could end up anywhere.
        hidden = f"Redis URL {url.partition('://')[0]}://(hidden)"
        parts = urlsplit(url)
        if parts.scheme != "unix" and not re.fullmatch(r"/?\d*", parts.path):
            raise ValueError(f"{hidden}: the path must be the database number, e.g. /0 (percent-encode / ? # % @ "
                             "in the password)")
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S,
                                                health_check_interval=30)
        except ValueError:
            raise ValueError(f"{hidden} is not valid: expected redis://[user:password@]host:port/db, with / ? # % @ "
                             "percent-encoded in the password") from None
        self._lock = threading.Lock()
        self._down_since: float | None = None  # set while the tier is off
        self._closed = threading.Event()
        self._used = 0
        self._used_checked = 0.0
        try:
            self._call(self._client.ping)  # logs once if the server is down or refuses us at start
        except TypeError as exc:  # an unknown query argument reaches the connection only now
            raise ValueError(f"Redis URL {self.url}: {exc}") from None

    @property
    def available(self) -> bool:
        return self._down_since is None

    def _call(self, fn, *args, **kwargs):
        """fn(*args), or None when the server is off or fails (then it is off until the probe
        thread reaches it again: callers never wait on a server that is down)."""
        if self._down_since is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except (redis.RedisError, OSError) as exc:
            self._mark_down(exc)
            return None

    def _mark_down(self, exc: Exception) -> None:
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
        logger.warning("Redis KV tier %s unavailable (%s): off, retrying every %.0f s", self.url, exc, RETRY_S)
        threading.Thread(target=self._probe, name="kv-store-redis-probe", daemon=True).start()

    def _probe(self) -> None:
        while not self._closed.wait(RETRY_S):
            try:
                self._client.ping()
            except (redis.RedisError, OSError):
                continue
            with self._lock:
                self._down_since = None
            logger.warning("Redis KV tier %s is back", self.url)
            return

    def contains(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        def exists():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.prefix + key)
            return pipe.execute()
        found = self._call(exists)
        return [bool(f) for f in found] if found is not None else [False] * len(keys)

    def get(self, key: str) -> torch.Tensor | None:
        # At most one byte more than a payload can be: a planted huge value is never fetched whole.
        limit = serde.max_size(self.fmt.nbytes)
        data = self._call(self._read, self.prefix + key, limit)
        if not data:  # (GETRANGE of a missing key is empty)
            return None
        try:
            if isinstance(data, redis.ResponseError):
                raise serde.CorruptPayload("corrupt", f"not a string value ({data})")
            if len(data) > limit:
                raise serde.CorruptPayload("corrupt", f"larger than a payload ({limit} bytes)")
            return serde.decode(data, self.fmt.fingerprint, self.fmt.dtype, list(self.fmt.shape), key, self.secret)
        except serde.CorruptPayload as exc:
            self.reject(key, exc)
            self._call(self._client.delete, self.prefix + key)
            return None

    def _read(self, name: str, limit: int) -> bytes | redis.ResponseError:
        try:
            return self._client.getrange(name, 0, limit)
        except redis.ResponseError as exc:  # WRONGTYPE: a list or hash planted under our key, not a server down
            return exc

    def put(self, key: str, kv: torch.Tensor) -> None:
        payload = b"".join(serde.encode(kv, self.fmt.fingerprint, self.fmt.shape[2] * self.fmt.shape[3], key,
                                        self.secret))
        # nx: an entry already there is identical (same key, same model): keep it, refresh nothing.
        if self._call(self._client.set, self.prefix + key, payload, ex=self.ttl_s, nx=True):
            self.count(bytes_stored=len(payload))

    def used_bytes(self) -> int:
        """The server's used memory, refreshed at most every 5 s (it is shared, not ours alone)."""
        now = time.monotonic()
        if now - self._used_checked > 5 and self.available:
            self._used_checked = now
            info = self._call(self._client.info, "memory")
            if info:
                self._used = int(info.get("used_memory", 0))
        return self._used

    def close(self) -> None:
        self._closed.set()
        self._client.close()
