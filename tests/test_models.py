"""Greedy token ids equal HF transformers' generate on the same weights, per model family."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import HFReference, assert_engine_idle, make_tiny_model

MAX_TOKENS = 24


def _candidates(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Shorter than a block, an exact block multiple, and longer ones.
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 16, 37, 130, 7, 32, 64, 200, 11, 48)]


def _check_family(model_dir, attention_backend: str = "auto") -> None:
    """Exact greedy equality with transformers on 4 prompts of different lengths whose reference
    path has no near-ties (a tie can legitimately break either way under float reordering), and
    at every generated position the top-5 log-probabilities within 1e-3 of transformers'."""
    hf = HFReference(model_dir)
    prompts, expected = hf.well_conditioned(_candidates(), MAX_TOKENS, count=4)
    # float32: the reference is transformers in float32 (auto is bfloat16 on CPUs that have it).
    llm = LLM(str(model_dir), num_blocks=128, attention_backend=attention_backend, dtype="float32")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                   logprobs=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert len(set(expected[0])) > 3, "reference output is degenerate; the comparison would be weak"
    for prompt, tokens, output in zip(prompts, expected, outputs):
        assert hf.top_logprob_error(prompt, tokens, output.outputs[0].logprobs) <= 1e-3
    assert_engine_idle(llm)


# Gemma's defaults (head_dim 256, window 4096) are shrunk so that a 200-token prompt crosses
# several windows; Gemma 3 gets one sliding and one global layer, and linear rope scaling on
# the global one, so both of its rope tables are exercised.
# Untied: with tied, sqrt(hidden)-scaled random embeddings make the tiny models repeat one token.
GEMMA_TINY = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=24, hidden_activation="gelu_pytorch_tanh",
                  tie_word_embeddings=False)
FAMILIES = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama3.2-tied-rope-scaling": ("llama", dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-sliding-upper-layers": ("qwen3", dict(head_dim=16, use_sliding_window=True, sliding_window=24,
                                                 max_window_layers=1)),
    "gemma2-softcap-alternating": ("gemma2", dict(GEMMA_TINY, final_logit_softcapping=3.0,
                                                  attn_logit_softcapping=2.0)),
    "gemma3-local-rope-qk-norm": ("gemma3", dict(GEMMA_TINY, layer_types=["sliding_attention", "full_attention"],
                                                 rope_scaling=dict(rope_type="linear", factor=8.0),
                                                 rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)),
    "phi3-partial-rotary-window": ("phi3", dict(tie_word_embeddings=False, partial_rotary_factor=0.5,
                                                sliding_window=24, pad_token_id=0)),
    # Phi-3.5/Phi-4-mini style: served up to the original context, with the short factors.
    "phi3.5-longrope": ("phi3", dict(tie_word_embeddings=False, pad_token_id=0, original_max_position_embeddings=256,
                                     max_position_embeddings=1024, rope_scaling=dict(
                                         rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5],
                                         long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0]))),
    "llama3-rope-scaling": ("llama", dict(tie_word_embeddings=False, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=False)),
    "mistral-gqa": ("mistral", dict(tie_word_embeddings=False, num_key_value_heads=1, sliding_window=None)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family, tmp_path, smollm2_dir):
    arch, overrides = FAMILIES[family]
    _check_family(make_tiny_model(tmp_path, arch, **overrides))


@pytest.mark.parametrize("family", ["llama-tied", "gemma2-softcap-alternating", "qwen3-qk-norm", "phi3-partial-rotary-window"])
def test_the_torch_path_matches_transformers_too(family, tmp_path, smollm2_dir):
    """--attention-backend torch: the pure-torch path (SDPA, torch layer ops), end to end."""
    arch, overrides = FAMILIES[family]
    _check_family(make_tiny_model(tmp_path, arch, **overrides), attention_backend="torch")


def test_mistral_sliding_window_matches_transformers(tmp_path, smollm2_dir):
    _check_family(make_tiny_model(tmp_path, "mistral", tie_word_embeddings=False, sliding_window=24))


def test_unsupported_architecture_names_supported_ones(tmp_path, tiny_llama):
    import json
    import shutil
    shutil.copytree(tiny_llama, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM.*Gemma3ForCausalLM.*Phi3"):
        LLM(str(tmp_path / "m"), num_blocks=16)


def test_gemma3_image_text_checkpoint_serves_its_text_model(tmp_path, smollm2_dir):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: nested text_config, weights
    under language_model., a vision tower the engine skips. (Released ones tie the output to the
    embedding; untied here, as a tied random model repeats one token, so lm_head's name is
    exercised too.)"""
    import transformers as tf
    from tests.conftest import TINY_COMMON
    text = {**TINY_COMMON, **GEMMA_TINY, "layer_types": ["sliding_attention", "full_attention"]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=16)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                             image_token_index=49151, boi_token_index=49150, eoi_token_index=49149,
                             tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.Gemma3ForConditionalGeneration(config).eval().save_pretrained(tmp_path)
    tf.AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(tmp_path)
    _check_family(tmp_path)
