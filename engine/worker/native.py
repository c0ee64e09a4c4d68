"""The native CPU kernels of csrc/cpu (paged attention, fused norms, activations, rope, KV
writes, linear layers over quantized blocks), loaded for the instruction set this CPU runs.

``pip install -e .`` builds them twice, for AVX-512 and for AVX2 (engine/_C_avx512 and
engine/_C_avx2); this module picks the best one the CPU supports. Where none can run (not
built, another architecture, a CPU without AVX2, ENGINE_NATIVE=0) the engine runs its torch
path and says why once in the log. ENGINE_NATIVE_ISA=avx2 forces the AVX2 build on an
AVX-512 machine (tests and benchmarks of the other path).
"""
from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

logger = logging.getLogger("engine.worker")

ISAS = ("avx512", "avx2")
# What each build was compiled for (setup.py's -m flags); a CPU must have all of them.
_REQUIRED_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"},
                   "avx2": {"avx2", "fma", "f16c"}}


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX) and oneDNN uses it."""
    if not {"avx512_bf16", "amx_bf16"} & cpu_flags():
        return False
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def supported_isas() -> list[str]:
    """The builds this CPU can run, best first."""
    return [isa for isa in ISAS if _REQUIRED_FLAGS[isa] <= cpu_flags()]


@functools.cache
def load(isa: str):
    """torch.ops.engine_<isa> (the ops of that build); raises ImportError or RuntimeError when it
    cannot run here."""
    if isa not in supported_isas():
        raise RuntimeError(f"this CPU lacks {', '.join(sorted(_REQUIRED_FLAGS[isa] - cpu_flags()))} for the {isa} build")
    importlib.import_module(f"engine._C_{isa}")
    return getattr(torch.ops, f"engine_{isa}")


@functools.cache
def _select() -> tuple[str | None, str]:
    """(the ISA to use, the reason when it is None)."""
    if os.environ.get("ENGINE_NATIVE", "1") == "0":
        return None, "ENGINE_NATIVE=0"
    forced = os.environ.get("ENGINE_NATIVE_ISA")
    if forced is not None and forced not in ISAS:
        return None, f"ENGINE_NATIVE_ISA={forced!r} is not one of {', '.join(ISAS)}"
    candidates = [forced] if forced else supported_isas()
    if not candidates:
        return None, "this CPU has neither AVX-512 nor AVX2 (or is not x86)"
    errors = []
    for isa in candidates:
        try:
            load(isa)
            return isa, ""
        except (ImportError, RuntimeError, OSError) as exc:
            errors.append(f"{isa}: {exc}")
    return None, "; ".join(errors) + " (were they built? pip install --no-build-isolation -e .)"


def ops():
    """The kernels' op namespace for this CPU, or None (the torch path runs; logged once)."""
    isa, reason = _select()
    if isa is None:
        _log_once(f"native CPU kernels unavailable ({reason}): using the torch path")
        return None
    _log_once(f"native CPU kernels: {isa}")
    return load(isa)


def small_rows_linear_supported() -> bool:
    """Whether small_rows_linear runs here: the avx512 build on a CPU with AVX512-BF16."""
    return _select()[0] == "avx512" and "avx512_bf16" in cpu_flags()


def unavailable_reason() -> str | None:
    return _select()[1] or None


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)
