"""Weights that stay quantized (engine/worker/quantized.py, csrc/cpu/quant_linear.h).

Oracles: gguf-py (llama.cpp's reference quantizers and dequantizers, ported) for the block
formats; a float64 product with the dequantized weights for the native kernels, on generated
shapes and both ISA builds; transformers for whole models (reading the .gguf with its own GGUF
reader, or given weights quantized and dequantized by the reference)."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.worker import native
from engine.worker.gguf_convert import _kept_quantized
from engine.worker.quantized import (BLOCK_BYTES, Q4_0, Q4_1, Q8_0, QK, TYPE_NAMES, QuantEmbedding, QuantLinear,
                                     dequantize, from_kernel_rows, quantize, to_kernel_rows)
from tests.conftest import HFReference, assert_engine_idle, make_tiny_model, round_inputs_to_q8_0, rounded_to_q8_0

TYPES = (Q4_0, Q4_1, Q8_0)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISAS = native.supported_isas()  # as test_native_kernels: both builds on an AVX-512 machine


def _random_blocks(rng: np.random.Generator, rows: int, groups: int, qtype: int) -> torch.Tensor:
    """Valid blocks with any integers and scales (and Q4_1 minimums) across fp16's range."""
    b = rng.integers(0, 256, size=(rows, groups, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scales = 2. ** rng.uniform(-14, 2, size=(rows, groups, 2)) * rng.choice([-1, 1], size=(rows, groups, 2))
    b[..., :4 if qtype == Q4_1 else 2] = scales.astype(np.float16).view(np.uint8)[..., :4 if qtype == Q4_1 else 2]
    return torch.from_numpy(b.reshape(rows, -1))


def _block_scales(blocks: torch.Tensor) -> torch.Tensor:
    """The fp16 scale d of every block of GGUF-layout rows, as float64 [rows, groups]."""
    rows = blocks.shape[0]
    return blocks.view(rows, -1, BLOCK_BYTES[Q8_0])[..., :2].contiguous().view(torch.float16).double()[..., 0]


# ---- the reference against gguf-py (llama.cpp's own rounding) -------------------------------

@settings(max_examples=60, deadline=None, derandomize=True)
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 6), groups=st.integers(1, 5), seed=st.integers(0, 2**32 - 1),
       log_scale=st.floats(-6, 3))
def test_dequantize_and_quantize_equal_llama_cpps_reference(qtype, rows, groups, seed, log_scale):
    rng = np.random.default_rng(seed)
    ggml = gguf.GGMLQuantizationType[TYPE_NAMES[qtype]]
    blocks = _random_blocks(rng, rows, groups, qtype)
    expected = gguf.quants.dequantize(blocks.numpy(), ggml).reshape(rows, groups * QK)
    assert np.array_equal(dequantize(blocks, qtype).numpy(), expected)
    if qtype == Q4_0:
        return  # the engine quantizes to Q4_1 and Q8_0 only
    w = (rng.standard_normal((rows, groups * QK)) * 10. ** log_scale).astype(np.float32)
    w[0, :QK] = 0  # an all-zero group: scale 0, no division by it
    if rows > 1:  # a group of exact halves after scaling (scale 1): rounding ties go away from zero
        ties = np.arange(QK, dtype=np.float32) % 15 + 0.5
        ties[:2] = (0, 15) if qtype == Q4_1 else (-3.5, 127)
        w[-1, -QK:] = ties
    assert np.array_equal(quantize(torch.from_numpy(w), qtype).numpy(), gguf.quants.quantize(w, ggml))


def test_quantize_refuses_what_it_cannot_make():
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize(torch.zeros(4, 48), Q8_0)
    with pytest.raises(ValueError, match="Q4_0"):
        quantize(torch.zeros(4, 64), Q4_0)


# ---- the native kernels against the reference, both builds ----------------------------------

@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(qtype=st.sampled_from(TYPES), dtype=st.sampled_from(DTYPES), m=st.one_of(st.integers(0, 9), st.sampled_from([17, 70])),
       n=st.integers(1, 40),
       # Past 16 blocks (the Q4_1 minimums' full vectors) and past 64 (a second stage of scales).
       groups=st.one_of(st.integers(1, 6), st.sampled_from([16, 17, 65, 80])), pad=st.integers(0, 3),
       seed=st.integers(0, 2**32 - 1))
def test_native_kernels_equal_the_reference(isa, qtype, dtype, m, n, groups, pad, seed):
    ops = native.load(isa)
    rng = np.random.default_rng(seed)
    k = groups * QK
    blocks = _random_blocks(rng, n, groups, qtype)
    reference = dequantize(blocks, qtype)  # float32, exact
    # Rows with a stride past K (a view of a wider tensor): the kernel must follow it.
    x = torch.from_numpy(rng.standard_normal((m, k + pad)).astype(np.float32)).to(dtype)[:, :k]
    out = torch.full((m, n), float("nan"), dtype=dtype)
    packed = to_kernel_rows(blocks, qtype)
    ops.quant_linear(out, x, packed, qtype)
    # Q8_0 weights meet activations rounded to Q8_0 (integer dot products, as llama.cpp's).
    xr = rounded_to_q8_0(x) if qtype == Q8_0 else x.double()
    exact = xr @ reference.double().T
    # Only the order of float32 additions differs, then one rounding to the output dtype; for Q8_0
    # also the rounding of d_w * d_x and, on VNNI, of an offset of 128 * |x| * |d_w| per block.
    magnitude = xr.abs() @ reference.double().abs().T
    if qtype == Q8_0:
        magnitude += 128 * xr.abs() @ _block_scales(blocks).abs().repeat_interleave(QK, dim=1).T
    bound = magnitude * 4e-6 + exact.abs() * torch.finfo(dtype).eps
    assert ((out.double() - exact).abs() <= bound + 1e-30).all()
    # Batch invariance: each row alone gives its bits in the batch (a prefix hit's suffix, a
    # decode step and a prefill must project a token identically).
    for i in (sorted({0, m // 2, m - 1}) if m else []):
        alone = torch.empty(1, n, dtype=dtype)
        ops.quant_linear(alone, x[i:i + 1], packed, qtype)
        assert torch.equal(alone[0], out[i])


@pytest.mark.parametrize("isa", ISAS)
def test_a_q8_0_layer_keeps_a_nan_or_infinite_input_not_finite(isa):
    """Rounding to Q8_0 must not turn a NaN (or an infinity) into a number: its row's outputs
    stay non-finite, as a float product's would, and the other rows are untouched."""
    ops = native.load(isa)
    packed = to_kernel_rows(_random_blocks(np.random.default_rng(0), 8, 3, Q8_0), Q8_0)
    x = torch.randn(3, 3 * QK, generator=torch.Generator().manual_seed(0))
    x[1, QK + 8], x[2, 5] = float("nan"), float("inf")
    out = torch.empty(3, 8)
    ops.quant_linear(out, x, packed, Q8_0)
    assert out[0].isfinite().all() and not out[1:].isfinite().any()
    alone = torch.empty(1, 8)
    ops.quant_linear(alone, x[:1], packed, Q8_0)
    assert torch.equal(alone[0], out[0])


@settings(max_examples=30, deadline=None, derandomize=True)
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 5), groups=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_the_kernel_row_layout_keeps_every_block(qtype, rows, groups, seed):
    """Packing is a permutation of a row's bytes that unpacks to GGUF's blocks; an embedding
    looks rows up in the packed table and dequantizes them as the reference does."""
    blocks = _random_blocks(np.random.default_rng(seed), rows, groups, qtype)
    packed = to_kernel_rows(blocks, qtype)
    assert packed.shape == blocks.shape and torch.equal(from_kernel_rows(packed, qtype), blocks)
    assert torch.equal(packed.sort(dim=1).values, blocks.sort(dim=1).values)
    embedding = QuantEmbedding(rows, groups * QK, qtype, torch.float32)
    embedding.weight.data = packed
    ids = torch.tensor([rows - 1, 0, rows - 1])
    assert torch.equal(embedding(ids), dequantize(blocks, qtype)[ids])


@pytest.mark.skipif(not ISAS, reason="no native build runs on this CPU")
def test_native_kernels_refuse_bad_arguments():
    ops = native.load(ISAS[0])
    blocks = torch.zeros(8, 2 * BLOCK_BYTES[Q4_1], dtype=torch.uint8)
    x, out = torch.zeros(1, 64), torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="GGML type"):
        ops.quant_linear(out, x, blocks, 5)
    with pytest.raises(RuntimeError, match="whole blocks"):
        ops.quant_linear(out, x, blocks[:, :30].contiguous(), Q4_1)
    with pytest.raises(RuntimeError, match="input must be"):
        ops.quant_linear(out, torch.zeros(1, 32), blocks, Q4_1)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.quant_linear(torch.zeros(1, 9), x, blocks, Q4_1)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.quant_linear(out, x, blocks.to(torch.int8), Q4_1)


@pytest.mark.skipif(not ISAS, reason="no native build runs on this CPU")
def test_a_bias_is_added_before_the_one_rounding_to_bfloat16():
    """x W^T + b rounded once to bf16 (as nn.Linear does), not the product rounded and then the sum."""
    torch.manual_seed(0)
    layer = QuantLinear(64, 256, Q8_0, bias=True, ops=native.load(ISAS[0]))
    layer.weight.data = to_kernel_rows(quantize(torch.randn(256, 64), Q8_0), Q8_0)
    layer.bias = torch.nn.Parameter(torch.randn(256).to(torch.bfloat16), requires_grad=False)
    x = torch.randn(3, 64).to(torch.bfloat16)
    product = torch.empty(3, 256)
    layer.ops.quant_linear(product, x.float(), layer.weight, Q8_0)
    assert torch.equal(layer(x), (product + layer.bias.float()).to(torch.bfloat16))


# ---- the converter ---------------------------------------------------------------------------

class _Tensor:
    def __init__(self, type_name: str, dims: int = 2) -> None:
        self.tensor_type = gguf.GGMLQuantizationType[type_name]
        self.shape = (64,) * dims


def test_a_fused_projection_stays_quantized_only_when_its_parts_share_a_type():
    named = {"model.layers.0.self_attn.q_proj.weight": _Tensor("Q4_1"),
             "model.layers.0.self_attn.k_proj.weight": _Tensor("Q4_1"),
             "model.layers.0.self_attn.v_proj.weight": _Tensor("Q8_0"),  # mixed: all three dequantized
             "model.layers.0.self_attn.o_proj.weight": _Tensor("Q4_0"),
             "model.layers.0.mlp.gate_proj.weight": _Tensor("Q8_0"),
             "model.layers.0.mlp.up_proj.weight": _Tensor("Q8_0"),
             "model.layers.0.mlp.down_proj.weight": _Tensor("Q4_K"),  # a K-quant: dequantized
             "model.layers.0.input_layernorm.weight": _Tensor("F32", dims=1),
             "model.embed_tokens.weight": _Tensor("Q8_0")}
    assert _kept_quantized(named) == {"model.layers.0.self_attn.o_proj.weight": "Q4_0",
                                      "model.layers.0.mlp.gate_proj.weight": "Q8_0",
                                      "model.layers.0.mlp.up_proj.weight": "Q8_0",
                                      "model.embed_tokens.weight": "Q8_0"}


# ---- whole models ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_fp32(smollm2_dir) -> LLM:
    return LLM(num_blocks=256, dtype="float32")


def test_the_default_gguf_runs_as_stored(default_fp32):
    model = default_fp32.engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 30 * 4 + 1 and isinstance(model.embed_tokens, QuantEmbedding)
    assert {m.qtype for m in linears[:-1]} == {Q4_1} and model.lm_head.qtype == Q8_0
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: one table
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    from engine.worker.loader import default_model_path
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes <= os.path.getsize(default_model_path())  # not widened anywhere


def test_the_default_gguf_matches_transformers_reading_it(default_fp32, smollm2_dir):
    """Greedy tokens equal transformers' on the dequantized .gguf (float32, its Q8_0 output
    layer's input rounded to Q8_0 as the kernel does), and top-5 log-probabilities are within 2e-4
    of its, teacher-forced (measured: under 5e-5), but where a rounding half falls between the two."""
    hf = HFReference(smollm2_dir)
    candidates = [default_fp32.get_tokenizer().encode(p) for p in
                  ("The capital of France is", "def fibonacci(n):", "The three primary colors are",
                   "Water boils at", "Once upon a time, in a small village,")]
    prompts, expected = hf.well_conditioned(candidates, 16, count=3)
    outputs = default_fp32.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5),
                                    use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # Its output layer is Q8_0: the kernel rounds its input, as the reference does.
    hf.assert_q8_0_logprobs_close([(p, t, o.outputs[0].logprobs) for p, t, o in zip(prompts, expected, outputs)], 2e-4)
    assert_engine_idle(default_fp32)


def test_quantization_is_refused_where_it_does_not_apply(default_fp32, tiny_llama):
    with pytest.raises(ValueError, match="quantizes a float checkpoint"):
        LLM(quantization="int8", num_blocks=16)
    with pytest.raises(ValueError, match="needs a .gguf"):
        LLM(str(tiny_llama), quantization="gguf", num_blocks=16)
    with pytest.raises(ValueError, match="int4, int8 or gguf"):
        LLM(str(tiny_llama), quantization="fp8", num_blocks=16)


@pytest.fixture(scope="module")
def tiny_for_quantization(tmp_path_factory) -> object:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-q"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_qwen2_untied(tmp_path_factory) -> object:
    """q/k/v biases (random: transformers initializes them to zero) and an output layer quantized
    on its own."""
    import transformers as tf
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-q-qwen2"), "qwen2", tie_word_embeddings=False)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def _reference_of_quantized(model_dir, out_dir, qtype):
    """The checkpoint with every linear weight (so the embedding too when the output layer is tied
    to it, not otherwise) replaced by the reference's dequantize(quantize(w)): what int4/int8
    must compute."""
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantize(quantize(module.weight, qtype), qtype))
    model.save_pretrained(out_dir)
    tf.AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


@pytest.mark.parametrize("method,model", [("int8", "tiny_for_quantization"), ("int4", "tiny_for_quantization"),
                                          ("int8", "tiny_qwen2_untied")])
def test_quantization_at_load_computes_the_quantized_checkpoint(method, model, tmp_path, request):
    """Greedy tokens and top-5 log-probabilities equal transformers' on the checkpoint whose weights
    the reference quantized and dequantized (within 1e-4; for int8 with every linear's input
    rounded to Q8_0, as the kernel does), and differ measurably from the unquantized
    checkpoint's (so the comparison can tell the two apart)."""
    qtype = {"int8": Q8_0, "int4": Q4_1}[method]
    tiny = request.getfixturevalue(model)
    hf = HFReference(_reference_of_quantized(tiny, tmp_path / "reference", qtype))
    if qtype == Q8_0:  # the native kernel's input rounding (llama.cpp's) for Q8_0 weights
        round_inputs_to_q8_0(hf.model, [n for n, m in hf.model.named_modules() if isinstance(m, torch.nn.Linear)])
    unquantized = HFReference(tiny)
    rng = np.random.default_rng(1)
    candidates = [rng.integers(3, 49152, size=n).tolist() for n in (5, 16, 37, 64, 11, 130)]
    prompts, expected = hf.well_conditioned(candidates, 16, count=3)
    llm = LLM(str(tiny), quantization=method, num_blocks=64, dtype="float32")
    runner_model = llm.engine.core.runner.model
    assert {m.qtype for m in runner_model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))} == {qtype}
    assert sum(isinstance(m, QuantLinear) for m in runner_model.modules()) == 2 * 4 + 1
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    runs = [(p, t, o.outputs[0].logprobs) for p, t, o in zip(prompts, expected, outputs)]
    if qtype == Q8_0:
        hf.assert_q8_0_logprobs_close(runs, 1e-4)
    else:
        assert max(hf.top_logprob_error(*run) for run in runs) <= 1e-4
    assert max(unquantized.top_logprob_error(p, t, o.outputs[0].logprobs)
               for p, t, o in zip(prompts, expected, outputs)) > 1e-3
    plain_llm = LLM(str(tiny), num_blocks=16, dtype="float32")
    assert plain_llm.engine.core.fingerprint != llm.engine.core.fingerprint  # P/D peers and stores tell them apart
    assert_engine_idle(llm)


def test_without_native_kernels_the_weights_are_dequantized_once_and_say_why(tiny_for_quantization):
    code = ("import sys; from engine import LLM, SamplingParams;"
            "llm = LLM(sys.argv[1], quantization='int8', num_blocks=16, dtype='float32');"
            "o = llm.generate([{'prompt_token_ids': [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=8,"
            " ignore_eos=True), use_tqdm=False);"
            "print(llm.engine.core.fingerprint);"
            "print(type(llm.engine.core.runner.model.lm_head).__name__, o[0].outputs[0].token_ids)")
    runs, fingerprints = {}, {}
    for flag in ("0", "1"):
        result = subprocess.run([sys.executable, "-c", code, str(tiny_for_quantization)], capture_output=True,
                                text=True, timeout=300, env={**os.environ, "ENGINE_NATIVE": flag})
        assert result.returncode == 0, result.stderr
        lines = result.stdout.strip().splitlines()
        runs[flag] = lines[-1].split(" ", 1)
        fingerprints[flag] = lines[-2]
        widened = "10 quantized weights are dequantized to torch.float32 at load (ENGINE_NATIVE=0)" in result.stderr
        assert widened == (flag == "0"), result.stderr
    assert runs["1"][0] == "QuantLinear" and runs["0"][0] != "QuantLinear"
    assert runs["0"][1] == runs["1"][1]  # the same quantized model either way
    # ... whose KV differs in its last bits: peers and stores keep them apart.
    assert ":qk" not in fingerprints["0"] and ":qk3-" in fingerprints["1"]


def test_the_fingerprint_names_the_kernels_way(monkeypatch):
    """bf16 dot products only for Q4 blocks under bf16 activations on the AVX-512 build of a CPU
    with AVX512-BF16; float32 FMAs otherwise; Q8_0 blocks by VNNI on the AVX-512 build of a CPU
    with AVX512-VNNI, by vpmaddubsw otherwise; nothing for a model without quantized weights."""
    from engine.worker import native
    from engine.worker.quantized import kernel_numerics
    cpu = torch.device("cpu")
    monkeypatch.setattr(native, "_select", lambda: ("avx512", ""))
    monkeypatch.setattr(native, "load", lambda isa: types.SimpleNamespace(quant_linear=None))  # any CPU
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert kernel_numerics({"w": Q4_1}, None, torch.bfloat16, cpu) == ":qk3-avx512-bf16dot"
    assert kernel_numerics(None, "int4", torch.bfloat16, cpu) == ":qk3-avx512-bf16dot"
    assert kernel_numerics(None, "int8", torch.bfloat16, cpu) == ":qk3-avx512-i8madd"  # no VNNI
    assert kernel_numerics({"w": Q4_1, "lm_head": Q8_0}, None, torch.bfloat16, cpu) == ":qk3-avx512-bf16dot-i8madd"
    assert kernel_numerics({"w": Q4_0}, None, torch.float32, cpu) == ":qk3-avx512-f32"
    assert kernel_numerics({}, None, torch.bfloat16, cpu) == kernel_numerics(None, None, torch.bfloat16, cpu) == ""
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f", "avx512_vnni"}))
    assert kernel_numerics({"w": Q4_1}, None, torch.bfloat16, cpu) == ":qk3-avx512-f32"
    assert kernel_numerics({"w": Q4_1, "lm_head": Q8_0}, None, torch.float32, cpu) == ":qk3-avx512-f32-i8vnni"
    monkeypatch.setattr(native, "_select", lambda: ("avx2", ""))
    assert kernel_numerics(None, "int8", torch.bfloat16, cpu) == ":qk3-avx2-i8madd"  # VNNI is the AVX-512 build's
    monkeypatch.setattr(native, "_select", lambda: ("avx512", ""))
    monkeypatch.setattr(native, "load", lambda isa: types.SimpleNamespace())  # a build older than the kernel
    assert kernel_numerics({"w": Q4_1}, None, torch.bfloat16, cpu) == ""
    monkeypatch.setattr(native, "_select", lambda: (None, "ENGINE_NATIVE=0"))  # dense, as a float model
    assert kernel_numerics({"w": Q4_1}, None, torch.bfloat16, cpu) == ""
