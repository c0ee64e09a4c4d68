"""GGUF files of the Llama 3.x (rope factors), Qwen3, Gemma 2/3 and Phi-3 architectures load.

No such GGUF can be downloaded here, so each test writes one from a tiny random HF model the way
llama.cpp's convert_hf_to_gguf.py does (gguf-py's tensor-name map for the architecture, Gemma's
norms stored as 1 + w, Llama's q/k rows permuted and its llama3 rope scaling as a rope_freqs
tensor of per-frequency divisors, the architecture's metadata keys, SmolLM2's tokenizer fields
copied), then
checks two independent things (see the test).
"""
from __future__ import annotations

import functools
import math

import gguf
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.loader import default_model_path
from tests.conftest import HFReference, assert_engine_idle, make_tiny_model
from tests.test_models import FAMILIES, _candidates

# (family in test_models, what a GGUF of that architecture cannot express otherwise). llama.cpp
# fixes Gemma's attention scale to head_dim (but for the 27B models), Gemma 3's layer pattern to
# five sliding then one global, and writes no output tensor for Gemma 2 (always tied).
# (Qwen2 reads as Qwen3 does, without the q/k norms.)
CASES = {"llama": ("llama3.2-tied-rope-scaling", {}), "qwen3": ("qwen3-qk-norm", {}),
         "gemma2": ("gemma2-softcap-alternating", dict(query_pre_attn_scalar=16, tie_word_embeddings=True)),
         "gemma3": ("gemma3-local-rope-qk-norm", dict(query_pre_attn_scalar=16, num_hidden_layers=6,
                                                      layer_types=None)),
         "phi3": ("phi3-partial-rotary-window", {})}


def _llama3_rope_divisors(rope: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs for llama3 rope scaling."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for wavelen in 2 * math.pi / freqs:
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@functools.cache
def _smollm2_tokenizer_fields() -> list[tuple]:
    """SmolLM2's tokenizer as GGUF fields (the tiny models share it); parsed once, it is slow."""
    out = []
    for key, field in gguf.GGUFReader(default_model_path()).fields.items():
        if key.startswith("tokenizer."):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            out.append((key, field.contents(), field.types[0], field.types[-1] if array else None))
    return out


def write_gguf(model_dir, path, arch: str) -> None:
    """What llama.cpp's converter writes for this tiny model, in float32."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = dict(cfg.rope_parameters)
    if arch == "gemma3":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        scaling = rope["full_attention"]
        if scaling.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(scaling["factor"])
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "phi3":
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch in ("gemma2", "gemma3", "phi3") and cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for key, value, vtype, sub_type in _smollm2_tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)

    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                        cfg.num_hidden_layers)
    if arch == "llama" and (rope.get("rope_type") == "llama3"):
        writer.add_tensor("rope_freqs.weight", _llama3_rope_divisors(rope, head_dim))
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        base, suffix = name.rsplit(".", 1)
        if name_map.get_name(base) is None and base == "lm_head":
            continue  # Gemma 2: llama.cpp keeps only the (tied) embedding
        data = tensor.float()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(
                data.shape)  # llama.cpp's order for its rope kernel
        writer.add_tensor(f"{name_map.get_name(base)}.{suffix}", np.ascontiguousarray(data.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", list(CASES))
def test_gguf_of_the_family_loads_like_the_original(arch, tmp_path, smollm2_dir):
    """transformers' own GGUF reader recovers the original weights from the written file (so it
    follows llama.cpp's conventions, not just ours), and the engine, given the .gguf, generates
    exactly what transformers generates with the original model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    family, gguf_overrides = CASES[arch]
    overrides = {k: v for k, v in {**FAMILIES[family][1], **gguf_overrides}.items() if v is not None}
    model_dir = make_tiny_model(tmp_path / "hf", FAMILIES[family][0], **overrides)
    path = tmp_path / "gguf" / f"tiny-{arch}.gguf"
    path.parent.mkdir()
    write_gguf(model_dir, path, arch)

    skeleton = AutoModelForCausalLM.from_pretrained(model_dir)  # tiny: its names and shapes are what is used
    read = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    original = load_file(model_dir / "model.safetensors")
    original.pop("lm_head.weight", None) if arch == "gemma2" else None  # tied: not in the file
    assert set(read) == set(original)
    for name, tensor in original.items():
        torch.testing.assert_close(torch.as_tensor(read[name]).float(), tensor.float(), rtol=0, atol=1e-6,
                                   msg=name)

    hf = HFReference(model_dir)
    prompts, expected = hf.well_conditioned(_candidates(), 16, count=3)
    llm = LLM(str(path), num_blocks=128, dtype="float32")  # as the float32 reference
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_engine_idle(llm)
