"""bfloat16 linears for steps of up to 4 rows read plain weights with small_rows_linear
(csrc/cpu/small_rows_linear.h): its results against float64 products of the same bf16 values,
a row's bits whatever rows and threads share its step, and where the model runner takes it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM
from engine.worker import native
from engine.worker.cpu_linear import SMALL_ROWS, PackedLinear

needs_kernel = pytest.mark.skipif(not native.small_rows_linear_supported(),
                                  reason="small_rows_linear runs on the avx512 build on CPUs with AVX512-BF16")
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def small_rows_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    native.load("avx512").small_rows_linear(out, x, w)
    return out


@needs_kernel
@SETTINGS
@given(seed=st.integers(0, 2**31), m=st.integers(1, SMALL_ROWS), n=st.integers(1, 300), k=st.integers(1, 700),
       pad=st.integers(0, 40))
def test_matches_float64_products_rounded_once(seed, m, n, k, pad):
    """Every output within bf16's rounding of the exact sum, plus float32's summation error: K
    with and without a tail under 32, N not a multiple of the 4 rows a pass takes, rows of x
    strided inside a wider tensor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + pad, generator=g).to(torch.bfloat16)[:, :k]
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    exact = x.double() @ w.double().T
    summation = 2.0 ** -20 * (x.double().abs() @ w.double().abs().T)
    error = (small_rows_linear(x, w).double() - exact).abs()
    assert (error <= 2.0 ** -8 * exact.abs() + summation + 1e-30).all(), error.max()


@needs_kernel
@SETTINGS
@given(seed=st.integers(0, 2**31), m=st.integers(2, SMALL_ROWS), n=st.integers(1, 200), k=st.integers(1, 600))
def test_a_row_has_the_same_bits_alone_in_any_step_on_any_threads(seed, m, n, k):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    together = small_rows_linear(x, w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in range(m):
            assert torch.equal(small_rows_linear(x[i:i + 1], w), together[i:i + 1])
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_refuses_what_it_cannot_compute():
    ops = native.load("avx512")
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    for x, weight, message in ((torch.zeros(SMALL_ROWS + 1, 64, dtype=torch.bfloat16), w, "at most"),
                               (torch.zeros(1, 64), w, "dtype"),
                               (torch.zeros(1, 64, dtype=torch.bfloat16), w.t().contiguous().t(), "contiguous"),
                               (torch.zeros(1, 32, dtype=torch.bfloat16), w, r"\[rows, 64\]")):
        with pytest.raises(RuntimeError, match=message):
            ops.small_rows_linear(torch.empty(x.shape[0], 8, dtype=torch.bfloat16), x, weight)


@pytest.fixture(scope="module")
def bf16_dense_runners(tiny_llama):
    """A bfloat16 dense model with the small-rows copies and without (the default)."""
    llms = {"on": LLM(str(tiny_llama), dtype="bfloat16", num_blocks=32, small_rows_linear=True),
            "off": LLM(str(tiny_llama), dtype="bfloat16", num_blocks=32)}
    yield {choice: llm.engine.core.runner for choice, llm in llms.items()}
    for llm in llms.values():
        llm.shutdown()


@needs_kernel
def test_the_runner_keeps_plain_weights_only_when_asked(bf16_dense_runners):
    def packed(runner):
        return [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert packed(bf16_dense_runners["on"]) and all(m.small_weight is not None for m in packed(bf16_dense_runners["on"]))
    assert packed(bf16_dense_runners["off"]) and all(m.small_weight is None for m in packed(bf16_dense_runners["off"]))
    assert bf16_dense_runners["on"].model.fused.small_weights
    assert not bf16_dense_runners["off"].model.fused.small_weights


@needs_kernel
def test_packed_linear_takes_the_kernel_up_to_4_rows_and_onednn_above(bf16_dense_runners):
    module = bf16_dense_runners["on"].model.lm_head
    x = torch.randn(SMALL_ROWS + 1, module.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    onednn = torch.ops.mkldnn._linear_pointwise(x, module.packed_weight, None, "none", [], "")
    for m in range(1, SMALL_ROWS + 2):
        want = small_rows_linear(x[:m], module.small_weight) if m <= SMALL_ROWS else onednn
        assert torch.equal(module(x[:m]), want), m
    assert not torch.equal(small_rows_linear(x[:SMALL_ROWS], module.small_weight), onednn[:SMALL_ROWS])


def test_config_refuses_what_is_not_a_bool(tiny_llama):
    with pytest.raises(ValueError, match="small_rows_linear"):
        LLM(str(tiny_llama), small_rows_linear="on")
