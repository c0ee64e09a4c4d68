"""Attention backend selection, import guards, GPU memory sizing and the shared KV layout: the
parts of the CUDA path that run on CPU. (The kernels themselves are checked against the torch
backend by benchmarks/gpu_check.sh on a GPU.)"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine import EngineConfig
from engine.worker import native
from tests.conftest import AUTO_DTYPE
from engine.worker.backends import select_backend, unavailable_reason
from engine.worker.model_runner import cuda_kv_budget

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_the_native_kernel_on_cpu_and_explicit_cuda_backends_are_refused():
    expected = "torch" if native.unavailable_reason() else "cpu"
    assert select_backend("auto", CPU, torch.float32, 16, 64).name == expected
    assert select_backend("torch", CPU, torch.float32, 16, 64).name == "torch"
    # A head size the native kernel is not built for runs on torch, with the reason.
    assert select_backend("auto", CPU, torch.float32, 16, 80).name == "torch"
    assert "not 80" in unavailable_reason("cpu", CPU, torch.float32, 80)
    assert "runs on the CPU" in unavailable_reason("cpu", CUDA, torch.bfloat16, 64)
    for name in ("flash_attn", "xformers"):
        with pytest.raises(ValueError, match=f"--attention-backend {name}: {name} needs a CUDA device"):
            select_backend(name, CPU, torch.float32, 16, 64)


def test_unavailable_reasons_name_the_problem():
    installed = {n: __import__("importlib").util.find_spec(n) is not None for n in ("flash_attn", "xformers")}
    for name, present in installed.items():
        reason = unavailable_reason(name, CUDA, torch.bfloat16, 64)
        assert (reason is None) if present else ("not installed (pip install -e .[cuda])" in reason)
    if installed["flash_attn"]:
        assert "float16 or bfloat16" in unavailable_reason("flash_attn", CUDA, torch.float32, 64)
    assert "unknown attention backend" in unavailable_reason("tritonx", CUDA, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="attention_backend must be"):
        EngineConfig(attention_backend="tritonx")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_cpu_engine_never_imports_the_cuda_extras(tiny_llama):
    code = ("import sys\nfrom engine import LLM\nLLM(sys.argv[1], num_blocks=16).generate('hi', use_tqdm=False)\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('flash_attn', 'xformers')\n"
            "       or m in ('engine.worker.backends.flash_attn', 'engine.worker.backends.xformers')]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code, str(tiny_llama)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_gpu_kv_budget_is_this_instances_share_of_the_gpu():
    gib = 2**30
    # 140 GiB device; this instance holds 2 GiB (weights + context); 3 GiB kept for activations.
    assert cuda_kv_budget(140 * gib, 138 * gib, 2 * gib, 0.9, 3 * gib) == int(140 * gib * 0.9) - 2 * gib - 3 * gib
    # Another instance holding 60 GiB of the GPU is not charged to this one's share (two
    # instances at 0.4 fit one GPU): 0.4 * 140 - 2 - 3 = 51 GiB, and 78 GiB are free.
    assert cuda_kv_budget(140 * gib, 78 * gib, 2 * gib, 0.4, 3 * gib) == int(140 * gib * 0.4) - 5 * gib
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        cuda_kv_budget(16 * gib, 14 * gib, 12 * gib, 0.8, 1 * gib)  # weights alone take the share
    with pytest.raises(ValueError, match="other processes hold about 100.0 GiB"):
        cuda_kv_budget(140 * gib, 38 * gib, 2 * gib, 0.5, 3 * gib)  # 65 GiB wanted, 38 free
    # At a share of 1.0 this process's CUDA context outgrowing its 512 MiB allowance (by 0.3 GiB
    # here) is no other process: the KV takes what is free instead of refusing to start.
    free = int(140 * gib - 2 * gib - 0.3 * gib)
    assert cuda_kv_budget(140 * gib, free, 2 * gib, 1.0, 3 * gib) == free - 3 * gib - 256 * 2**20


def test_fingerprint_records_the_layout_not_the_backend(tiny_llama):
    from engine import LLM
    fingerprint = LLM(str(tiny_llama), num_blocks=16).engine.fingerprint
    # A CPU prefill and a flash-attn decode with the same dtype may exchange KV: no backend name.
    assert fingerprint.split(":")[1:] == [f"torch.{AUTO_DTYPE}", "bs16", "[L,2,N,bs,H,D]"]


def test_a_kv_tensor_mapped_from_a_file_is_host_memory_only(tmp_path):
    from engine.kv_transfer.base import allocate_kv_tensor
    with pytest.raises(ValueError, match="host memory, not on cuda"):
        allocate_kv_tensor((2, 4), torch.float32, CUDA, str(tmp_path / "kv"))
    assert allocate_kv_tensor((2, 4), torch.float32, CPU, str(tmp_path / "kv")).sum() == 0
