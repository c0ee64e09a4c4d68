"""Local-disk tier: one file per chunk, written atomically (temp file + rename), an LRU index
rebuilt from the directory at start (so it survives restarts), and a byte cap.

Files are named ``<namespace>-<key>.kv`` (``ChunkFormat.namespace``): engines of other chunk
formats (another model, dtype or ``--kv-chunk-tokens``) can share the directory without ever
reading, deleting or evicting each other's files; the byte cap counts this format's files only.

Prompts' KV is users' data: the directory is created 0700 and files 0600, whatever the umask.
A directory that already exists keeps its mode (it may be one the operator set up, or shared
like /tmp, where a chmod would do harm); if others can reach it we warn. Anyone who can write
to it can plant entries: with a deployment secret those are refused (serde.py)."""
from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import stat
import threading
import time

import torch

from engine.kv_transfer import serde
from engine.kv_transfer.secret import KVSecret
from engine.kv_events import MEDIUM_DISK
from engine.kv_transfer.stores.base import ChunkFormat, EvictingStore

logger = logging.getLogger("engine.kv_store")
SUFFIX = ".kv"


class DiskStore(EvictingStore):
    name = "disk"
    medium = MEDIUM_DISK

    def __init__(self, path: str, capacity_bytes: int, fmt: ChunkFormat, secret: KVSecret | None = None) -> None:
        super().__init__(fmt)
        self.dir = os.path.abspath(os.path.expanduser(path))
        self.capacity = capacity_bytes
        self.secret = secret
        os.makedirs(self.dir, mode=0o700, exist_ok=True)  # a new directory: owner only (see the docstring)
        mode = stat.S_IMODE(os.stat(self.dir).st_mode)
        if mode & 0o077:
            logger.warning("disk KV tier %s is open to other users (mode %o): chmod 700 it%s", self.dir, mode,
                           "" if secret else "; without a KV secret, entries others write there are served")
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()  # key -> bytes, LRU first
        self._used = 0
        self._last_write_warning = 0.0
        self._rebuild_index()

    def _rebuild_index(self) -> None:
        entries, unnamespaced = [], 0
        mine = self.fmt.namespace + "-"
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if time.time() - entry.stat().st_mtime > 60:  # a write cut short by a crash
                        os.unlink(entry.path)
            elif entry.name.startswith(mine) and entry.name.endswith(SUFFIX) and entry.is_file():
                stat = entry.stat()
                entries.append((stat.st_mtime, entry.name[len(mine):-len(SUFFIX)], stat.st_size))
            elif entry.name.endswith(SUFFIX) and "-" not in entry.name:
                unnamespaced += 1
        if unnamespaced:  # files of other formats are another engine's; these are nobody's
            logger.warning("disk KV tier %s: %d files named by key alone (written before entries were named by "
                           "chunk format) are never read: delete *.kv files without a '-' to free the space",
                           self.dir, unnamespaced)
        for _, key, size in sorted(entries):
            self._index[key] = size
            self._used += size
        if entries:
            logger.info("disk KV tier %s: %d chunks (%.1f MiB) found", self.dir, len(entries), self._used / 2**20)
        self._evict()

    def path(self, key: str) -> str:
        """The file of ``key``'s entry."""
        return os.path.join(self.dir, f"{self.fmt.namespace}-{key}{SUFFIX}")

    def contains(self, keys: list[str]) -> list[bool]:
        with self._lock:
            found = [k in self._index for k in keys]
        added = False
        for i, key in enumerate(keys):
            if not found[i]:  # written since our start by another engine sharing the directory
                try:
                    size = os.stat(self.path(key)).st_size
                except OSError:
                    continue
                with self._lock:
                    if key not in self._index:
                        self._index[key] = size
                        self._used += size
                        added = True
                found[i] = True
        if added:
            self._evict()
        return found

    def get(self, key: str) -> torch.Tensor | None:
        try:
            kv = serde.decode(self._read(key), self.fmt.fingerprint, self.fmt.dtype, list(self.fmt.shape), key,
                              self.secret)
        except OSError:  # deleted behind our back (or unreadable): a miss
            self._forget(key)
            return None
        except serde.CorruptPayload as exc:
            self.reject(key, exc)
            self._forget(key, unlink=True)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return kv

    def _read(self, key: str) -> bytes:
        """The entry's bytes. Only a regular file of at most a payload's size is read: a planted
        symlink is not followed, a FIFO never blocks, a huge (sparse) file is never loaded."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise serde.CorruptPayload("corrupt", "a symlink, not an entry") from None
            raise
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > serde.max_size(self.fmt.nbytes):
                raise serde.CorruptPayload("corrupt", f"not a regular file of at most a payload's size "
                                                      f"(mode {st.st_mode:o}, {st.st_size} bytes)")
            return f.read()

    def put(self, key: str, kv: torch.Tensor) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                self._log(key, True)
                return
        buffers = serde.encode(kv, self.fmt.fingerprint, self.fmt.shape[2] * self.fmt.shape[3], key, self.secret)
        size = sum(memoryview(b).nbytes for b in buffers)
        if size > self.capacity:
            return
        tmp = os.path.join(self.dir, f".{self.fmt.namespace}-{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.writelines(buffers)
            os.replace(tmp, self.path(key))  # readers see the whole file or none of it
        except OSError as exc:  # disk full, read-only, directory gone: skip this write
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            now = time.monotonic()
            if now - self._last_write_warning > 30:
                self._last_write_warning = now
                logger.warning("disk KV tier: write skipped (%s)", exc)
            return
        with self._lock:
            self._used += size - self._index.get(key, 0)  # contains() may have found the file already
            self._index[key] = size
            self._log(key, True)
        self._evict()
        self.count(bytes_stored=size)

    def _evict(self) -> None:
        """Least recently used first, pinned ones spared, until under the cap. Files go under
        the lock, so contains() never re-finds a file that is about to disappear."""
        with self._lock:
            for key in list(self._index):
                if self._used <= self.capacity:
                    break
                if self._pins[key]:
                    continue
                self._used -= self._index.pop(key)
                self._log(key, False)
                with contextlib.suppress(OSError):
                    os.unlink(self.path(key))

    def _forget(self, key: str, unlink: bool = False) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
                self._log(key, False)
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path(key))

    def used_bytes(self) -> int:
        return self._used
