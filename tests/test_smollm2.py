"""End to end on the real default model, SmolLM2-135M-Instruct (GGUF converted once)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from tests.conftest import HFReference, assert_engine_idle

MAX_TOKENS = 32
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The three primary colors are"]
CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> LLM:
    return LLM(num_blocks=512, dtype="float32")  # as the float32 reference


@pytest.fixture(scope="module")
def hf(smollm2_dir) -> HFReference:
    return HFReference(smollm2_dir)


def test_raw_prompts_match_transformers(smollm2, hf):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = smollm2.generate(RAW_PROMPTS, params, use_tqdm=False)
    prompts = [o.prompt_token_ids for o in outputs]
    for prompt, out, ref in zip(prompts, outputs, hf.greedy(prompts, MAX_TOKENS)):
        hf.assert_same(prompt, out.outputs[0].token_ids, ref)
    assert "Paris" in outputs[0].outputs[0].text
    assert_engine_idle(smollm2)


def test_chat_matches_transformers_and_stops_at_im_end(smollm2, hf):
    outputs = smollm2.chat(CHATS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    prompts = [o.prompt_token_ids for o in outputs]
    for prompt, out, ref in zip(prompts, outputs, hf.greedy(prompts, MAX_TOKENS)):
        ours = out.outputs[0].token_ids
        if out.outputs[0].finish_reason == "stop":
            # Stopped at <|im_end|>: the reference continues past EOS, compare up to it.
            assert ours[-1] == 2
            ref = ref[:len(ours)]
        hf.assert_same(prompt, ours, ref)
    assert "4" in outputs[0].outputs[0].text
    assert outputs[0].outputs[0].finish_reason == "stop"
    assert "<|im_end|>" not in outputs[0].outputs[0].text
    assert_engine_idle(smollm2)


def test_cli_generate_prints_a_completion(smollm2_dir):
    result = subprocess.run([sys.executable, "-m", "entrypoints.cli", "generate", "The capital of France is",
                             "--max-tokens", "8", "--num-blocks", "64"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
