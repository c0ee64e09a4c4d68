"""The deployment secret: what the prefill, decode and proxy processes of one deployment share,
and what nobody else on the network has.

One secret, many keys: each use derives its own key (HMAC-SHA256 of the secret and a purpose
name), so a tag made for one purpose never verifies for another. Uses:

- ``"params"``: prefill instances sign the ``kv_transfer_params`` they hand out; decode
  instances act only on signed ones (engine/kv_transfer/params.py).
- ``"socket"``: the challenge-response that opens a KV socket (engine/kv_transfer/p2p_wire.py).
- ``"curve-server"``, ``"curve-client"``: CURVE keypairs when the KV stream is encrypted.
- ``"store"``: the HMAC on every disk and Redis entry (engine/kv_transfer/serde.py).

The secret comes from ``--kv-secret-file PATH`` or the ``ENGINE_KV_SECRET`` environment
variable (the secret itself). It never appears in a log, a repr or a response.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat

logger = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16
ENV_VAR = "ENGINE_KV_SECRET"


class KVSecretError(ValueError):
    pass


class KVSecret:
    """Derives per-purpose keys from the deployment secret; compares tags in constant time."""

    __slots__ = ("_material", "_keys")

    def __init__(self, material: bytes | str) -> None:
        if isinstance(material, str):
            material = material.encode()
        material = material.strip()
        if len(material) < MIN_SECRET_BYTES:
            raise KVSecretError(f"the KV secret must be at least {MIN_SECRET_BYTES} bytes (got {len(material)}); "
                                "create one with: engine secret kv.secret")
        self._material = material
        self._keys: dict[str, bytes] = {}

    def __repr__(self) -> str:  # never the material
        return "KVSecret(<hidden>)"

    def __reduce__(self):  # pickled into the engine core process
        return (KVSecret, (self._material,))

    def key(self, purpose: str) -> bytes:
        """32 bytes that belong to ``purpose`` alone."""
        key = self._keys.get(purpose)
        if key is None:
            key = self._keys[purpose] = hmac.new(self._material, b"engine-kv/" + purpose.encode(),
                                                 hashlib.sha256).digest()
        return key

    def mac(self, purpose: str, *parts: bytes) -> bytes:
        """HMAC-SHA256 of ``parts`` (each length-prefixed, so no two splits collide)."""
        h = hmac.new(self.key(purpose), digestmod=hashlib.sha256)
        for part in parts:
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        return h.digest()

    def verify(self, purpose: str, tag: bytes, *parts: bytes) -> bool:
        return hmac.compare_digest(self.mac(purpose, *parts), tag)


def load_kv_secret(path: str | None = None) -> KVSecret | None:
    """The secret from ``path`` (a file holding it), else from $ENGINE_KV_SECRET, else None.
    Raises KVSecretError for an unreadable, too short or group/world-readable file."""
    if path:
        try:
            mode = os.stat(path).st_mode
            with open(path, "rb") as f:
                material = f.read()
        except OSError as exc:
            raise KVSecretError(f"cannot read the KV secret file {path}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KVSecretError(f"the KV secret file {path} is readable by others (mode {stat.S_IMODE(mode):o}): "
                                f"chmod 600 {path}")
        return KVSecret(material)
    value = os.environ.get(ENV_VAR)
    return KVSecret(value) if value else None


def new_secret() -> str:
    """A fresh random secret (256 bits, hex)."""
    return secrets.token_hex(32)


def write_secret_file(path: str, value: str | None = None) -> str:
    """Writes a secret (a new one unless given) to ``path`` with mode 0600; returns the path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((value or new_secret()) + "\n")
    os.chmod(path, 0o600)
    return path
