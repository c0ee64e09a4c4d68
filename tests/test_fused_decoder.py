"""The decoder's layers in one native call (engine/worker/fused_decoder.py) give the module loop's
bits: hidden states and KV cache writes, on generated mixed steps (decodes, prefill chunks over
cached context, sliding windows), for dense and quantized linears in float32 and bfloat16. And
only the models whose layers it computes exactly take it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import LLM
from engine.worker import native
from engine.worker.attention import StepAttention
from engine.worker.fused_decoder import FusedDecoder, fuse
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(native.ops() is None, reason=f"no native kernels: {native.unavailable_reason()}")

# (family, HF overrides, dtype, --quantization)
CASES = {
    "llama-float32-dense": ("llama", dict(tie_word_embeddings=True), "float32", None),
    "llama-bfloat16-dense": ("llama", dict(tie_word_embeddings=True), "bfloat16", None),
    # SmolLM2's widths in fp32: oneDNN computes a step of one row its own way at K = 1536.
    "llama-float32-dense-wide": ("llama", dict(tie_word_embeddings=True, hidden_size=576, intermediate_size=1536,
                                               num_attention_heads=9, num_key_value_heads=3), "float32", None),
    # SmolLM2's widths, with --small-rows-linear where this CPU runs it: long enough dot products
    # that the small-rows kernel's sums and oneDNN's round to different bf16 (steps of up to 4
    # rows take the former, both ways alike).
    "llama-bfloat16-dense-wide": ("llama", dict(tie_word_embeddings=True, hidden_size=576, intermediate_size=1536,
                                                num_attention_heads=9, num_key_value_heads=3), "bfloat16", None),
    "llama-bfloat16-int4": ("llama", dict(tie_word_embeddings=True), "bfloat16", "int4"),
    "llama-float32-int8": ("llama", dict(tie_word_embeddings=True), "float32", "int8"),
    "mistral-window-bfloat16-int8": ("mistral", dict(tie_word_embeddings=False, sliding_window=24), "bfloat16",
                                     "int8"),
}


@pytest.fixture(scope="module")
def runners(tmp_path_factory, smollm2_dir):
    built = {}

    def runner(case: str):
        if case not in built:
            family, overrides, dtype, quantization = CASES[case]
            small_rows = case.endswith("-wide") and native.small_rows_linear_supported()
            model_dir = make_tiny_model(tmp_path_factory.mktemp(case), family, **overrides)
            built[case] = LLM(str(model_dir), dtype=dtype, quantization=quantization, num_blocks=48,
                              enable_prefix_caching=False, small_rows_linear=small_rows).engine.core.runner
        return built[case]
    return runner


@st.composite
def mixed_steps(draw):
    """Per request: (new tokens, tokens already cached); decodes and prefill chunks mixed."""
    reqs = draw(st.integers(1, 5))
    return [(draw(st.sampled_from([1, 1, draw(st.integers(2, 40))])), draw(st.integers(0, 70))) for _ in range(reqs)]


@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=mixed_steps(), seed=st.integers(0, 2**32 - 1))
@example(step=[(1, 5), (1, 30), (1, 0)], seed=0)  # three decodes: a step of few rows
@example(step=[(1, 40)], seed=1)  # one decode: a step of one row
def test_one_native_call_gives_the_module_loops_bits(runners, case, step, seed):
    runner = runners(case)
    assert runner.model.fused is not None, f"{case} should run its layers in one native call"
    assert_same_bits(runner, step, seed)


def test_a_linear_without_a_small_rows_weight_keeps_its_own_kind(runners):
    """A .gguf may hold quantized linears beside dequantized ones: then only some linears have a
    small-rows weight, and each of the others runs its own kind, in both ways alike."""
    runner = runners("llama-bfloat16-dense-wide")
    model, fused = runner.model, runner.model.fused
    if not fused.small_weights:
        pytest.skip("this CPU runs no small-rows kernel")
    o_proj = model.layers[0].self_attn.o_proj
    kept = o_proj.small_weight
    steps = ([(1, 5)], [(1, 5), (1, 30), (1, 0)], [(12, 3)])
    try:
        o_proj.small_weight = None
        model.fused = FusedDecoder(model, runner.kernels)
        assert model.fused.small_weights[1].numel() == 0 and model.fused.small_weights[0].numel() > 0
        for seed, step in enumerate(steps):
            assert_same_bits(runner, step, seed)
        # The steps can tell the kernels apart: without any small-rows weight the native call
        # gives other bits than the module loop, which still has them on the other linears.
        model.fused.small_weights = []
        assert any(not torch.equal(*both_ways(runner, step, seed)[0]) for seed, step in enumerate(steps[:2]))
    finally:
        o_proj.small_weight, model.fused = kept, fused


def assert_same_bits(runner, step, seed):
    (hidden_loop, hidden_fused), (kv_loop, kv_fused) = both_ways(runner, step, seed)
    assert torch.isfinite(hidden_loop.float()).all()
    assert torch.equal(hidden_fused, hidden_loop)
    assert torch.equal(kv_fused, kv_loop)


def both_ways(runner, step, seed):
    """((hidden states, as the module loop, then the native call gives them), (their KV caches))
    of one generated step."""
    model = runner.model
    rng = np.random.default_rng(seed)
    bs, num_blocks = runner.block_size, runner.num_blocks
    order = rng.permutation(num_blocks).tolist()  # each request its own blocks, anywhere in the pool
    tables = []
    for q_len, cached in step:
        need = -(-(q_len + cached) // bs)
        tables.append([order.pop() for _ in range(need)])
    attention, positions = StepAttention.from_lists([q for q, _ in step], [c for _, c in step], tables, bs,
                                                    runner.device)
    metas = {w: runner.backend.build_metadata(attention, w) for w in model.config.attention_windows}
    ids = torch.from_numpy(rng.integers(3, model.config.vocab_size, size=len(positions)))
    # The cached context: random keys and values, the same for both ways.
    kv = torch.from_numpy(rng.standard_normal(runner.kv_caches.shape, dtype=np.float32)).to(runner.dtype)
    results = {}
    fused = model.fused
    try:
        for way, fuse in (("loop", None), ("fused", fused)):
            model.fused = fuse
            caches = kv.clone()
            with torch.inference_mode():
                results[way] = (model(ids, torch.from_numpy(positions), caches, metas), caches)
    finally:
        model.fused = fused
    hidden_loop, kv_loop = results["loop"]
    hidden_fused, kv_fused = results["fused"]
    return (hidden_loop, hidden_fused), (kv_loop, kv_fused)


@pytest.mark.parametrize("family,overrides,why", [
    ("qwen2", dict(tie_word_embeddings=False), "biases"),
    ("qwen3", dict(head_dim=32, tie_word_embeddings=True), "q/k norms"),
    ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=24, attn_logit_softcapping=2.0,
                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False), "soft-capping"),
])
def test_layers_it_cannot_compute_keep_the_module_loop(family, overrides, why, tmp_path, smollm2_dir, caplog):
    model_dir = make_tiny_model(tmp_path, family, **overrides)
    with caplog.at_level("INFO", logger="engine.worker"):
        llm = LLM(str(model_dir), dtype="float32", num_blocks=16)
    assert llm.engine.core.runner.model.fused is None
    assert why in caplog.text


def test_a_native_build_older_than_decoder_layers_schema_keeps_the_module_loop(runners, caplog):
    """A build from before small_rows_linear has decoder_layers without small_weights: every
    step would fail on its schema; the module loop runs instead and the log says why."""
    runner = runners("llama-float32-dense")

    class OldBuild:
        decoder_layers = object()
    kernels = type("Kernels", (), {"ops": type("Ops", (), {"k": OldBuild()})()})()
    with caplog.at_level("WARNING", logger="engine.worker"):
        assert fuse(runner.model, kernels) is None
    assert "predates" in caplog.text


def test_the_torch_attention_backend_keeps_the_module_loop(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=16, attention_backend="torch")
    assert llm.engine.core.runner.model.fused is None


def test_decoder_layers_refuses_what_does_not_match(runners):
    runner = runners("llama-float32-dense")
    fused = runner.model.fused
    x = torch.zeros(1, runner.model.config.hidden_size)
    meta = runner.backend.build_metadata(StepAttention.from_lists([1], [0], [[0]], runner.block_size,
                                                                  runner.device)[0], None)
    cos = torch.ones(1, runner.model.config.head_dim)
    args = dict(weights=fused.weights, kinds=fused.kinds, small=fused.small_weights, windows=fused.windows,
                kv=runner.kv_caches)
    for bad, message in ((dict(weights=fused.weights[:-1]), "weights"), (dict(kinds=fused.kinds[:-1]), "kinds"),
                         (dict(small=fused.weights[:1]), "small-row weights"), (dict(kv=runner.kv_caches[:1]), "kv_caches")):
        a = {**args, **bad}
        with pytest.raises(RuntimeError, match=message):
            fused.k.decoder_layers(x, x.clone(), a["weights"], a["kinds"], a["small"], a["windows"], cos, cos, a["kv"],
                                   meta.slot_mapping, meta.block_table, meta.query_start, meta.seq_lens,
                                   fused.num_heads, fused.num_kv_heads, 1e-5, 0.25, 0)
