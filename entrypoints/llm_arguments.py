"""vLLM's ``LLM(...)`` keyword arguments, as this engine reads them: each one is an EngineConfig
field, or one of vLLM's listed below with what it means here, or refused by name. None of
them is ever silently dropped; a value of None means the default."""
from __future__ import annotations

import dataclasses
import logging

from engine.config import EngineConfig

logger = logging.getLogger(__name__)

# Parallelism this engine does not have: 1 is what it does, anything else is refused.
SINGLE_DEVICE = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _read_vllm_only(name: str, value: object) -> None:
    """Checks one of vLLM's arguments that has no EngineConfig field (raises if its value asks
    for something this engine does not do)."""
    if name in SINGLE_DEVICE:
        if value != 1 or isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: this engine runs a model on one device; only 1 is supported")
    else:  # trust_remote_code
        # Models are this engine's own implementations: a checkpoint's code is never run, and the
        # flag only permits it.
        _flag(name, value)


VLLM_ONLY = frozenset(SINGLE_DEVICE + ("trust_remote_code",))
# EngineConfig fields that only a served engine acts on (engine/core.py): refused offline.
SERVER_ONLY = frozenset({"kv_events_config", "prefix_caching_hash_algo", "lend_cores_file", "borrow_cores_file"})
ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig) if f.init) - {"model"} - SERVER_ONLY


def engine_arguments(kwargs: dict) -> dict:
    """The EngineConfig keyword arguments of an LLM(...) call's keyword arguments."""
    served = sorted(SERVER_ONLY & {name for name, value in kwargs.items() if value is not None})
    if served:
        raise ValueError(f"{', '.join(served)}: only a served engine (engine serve) acts on this, not LLM()")
    unknown = sorted(set(kwargs) - ENGINE_FIELDS - VLLM_ONLY - SERVER_ONLY)
    if unknown:
        raise TypeError(f"LLM() got unsupported argument(s) {', '.join(unknown)}; "
                        f"accepted: {', '.join(sorted(ENGINE_FIELDS | VLLM_ONLY))}")
    out = {}
    for name, value in kwargs.items():
        if value is None:
            continue  # the default
        if name in VLLM_ONLY:
            _read_vllm_only(name, value)
        else:
            out[name] = value
    if "gpu_memory_utilization" in out:
        logger.info("gpu_memory_utilization=%s sizes the KV pool on CUDA only; on CPU the pool is "
                    "kv_cache_memory (or num_blocks)", out["gpu_memory_utilization"])
    return out
