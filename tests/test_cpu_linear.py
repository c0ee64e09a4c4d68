"""oneDNN-packed linear layers (engine/worker/cpu_linear.py) against torch's own, in the dtypes
the engine packs: fp32 always, bf16 where oneDNN supports it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.worker.cpu_linear import PackedLinear, onednn_available, pack_linears

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch(dtype, rows, bias):
    if not onednn_available(CPU, dtype):
        assert dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return  # nothing is packed here: the model keeps torch's nn.Linear
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=tol, atol=tol)


def test_pack_linears_replaces_every_linear_in_place():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4)))
    x = torch.randn(3, 8)
    expected = model(x)
    pack_linears(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 2
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536)])  # SmolLM2's qkv, gate_up, down
def test_a_packed_row_has_the_same_bits_in_any_step(dtype, shape):
    """What the equality suites rest on (outputs do not change with batching, preemption or prefix
    hits: tests/stress, test_consistency): oneDNN's rows do not depend on how many rows share the
    step. Measured so for bf16 too on SmolLM2's shapes; --small-rows-linear gives that up."""
    if not onednn_available(CPU, dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    g = torch.Generator().manual_seed(0)
    n, k = shape
    linear = PackedLinear(nn.Linear(k, n, bias=False).to(dtype))
    x = torch.randn(2048, k, generator=g).to(dtype)
    whole = linear(x)
    for rows in (1, 4, 5, 64, 300):
        assert torch.equal(linear(x[:rows]), whole[:rows]), rows
