"""engine.tokenizer_loading: the tokenizer AutoTokenizer gives, without importing the model stack,
and safe to share between the thread that encodes and the one that decodes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine.tokenizer_loading import load_tokenizer
from tests.conftest import make_tiny_model
from tests.server_utils import REPO

TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n", "émigré 日本語 🤖", "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "gemma2", "phi3"])
def family_dir(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def same_tokenizer(ours, auto) -> None:
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
        assert ours.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert ours.eos_token_id == auto.eos_token_id and ours.all_special_ids == auto.all_special_ids


def test_same_tokenizer_as_auto_tokenizer_for_each_family(family_dir):
    same_tokenizer(load_tokenizer(family_dir), AutoTokenizer.from_pretrained(family_dir))


def test_the_default_model(default_pair):
    same_tokenizer(*default_pair)


@pytest.mark.parametrize("declared", ["LlamaTokenizerFast", "GPT2Tokenizer", None])
def test_other_declared_classes_go_through_auto_tokenizer(tiny_llama, tmp_path, declared):
    model_dir = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if declared is None:
        config.pop("tokenizer_class")
    else:
        config["tokenizer_class"] = declared
    path.write_text(json.dumps(config))
    same_tokenizer(load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir))


def test_truncation_and_padding_saved_in_the_file_are_cleared(tiny_llama, tmp_path):
    """Else the first encode would switch them off (a write) while the other thread decodes."""
    model_dir = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    saved = AutoTokenizer.from_pretrained(model_dir)
    saved._tokenizer.enable_truncation(4)
    saved._tokenizer.enable_padding(length=16)
    saved._tokenizer.save(str(model_dir / "tokenizer.json"))
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer._tokenizer.truncation is None and tokenizer._tokenizer.padding is None
    assert len(tokenizer._tokenizer.encode("one two three four five six seven").ids) > 4


@pytest.fixture(scope="module")
def default_pair(smollm2_dir):
    return load_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(smollm2_dir)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(text=st.text(max_size=40))
def test_encodes_like_auto_tokenizer(default_pair, text):
    ours, auto = default_pair
    assert ours.encode(text) == auto.encode(text)


def test_one_tokenizer_encodes_and_decodes_on_two_threads_at_once(smollm2_dir):
    """The API server's tokenize thread and its output processor share one tokenizer."""
    tokenizer = load_tokenizer(smollm2_dir)
    text = "The quick brown fox jumps over the lazy dog. " * 20
    ids = tokenizer.encode(text)
    errors: list[BaseException] = []

    def encode() -> None:
        try:
            for _ in range(300):
                assert tokenizer.encode(text) == ids
                assert tokenizer([text, text])["input_ids"] == [ids, ids]  # the batch call frees the GIL
        except BaseException as exc:
            errors.append(exc)

    def decode() -> None:
        try:
            for _ in range(3000):
                assert tokenizer._tokenizer.decode(ids[:50]) == tokenizer._tokenizer.decode(ids[:50])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=encode), threading.Thread(target=decode)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


def test_loading_the_engine_imports_no_model_stack(tiny_llama):
    """AutoTokenizer's config class, and to_empty's meta-tensor path, import transformers'
    modeling stack and sympy: ~50 MiB resident for the process's life, for nothing."""
    code = ("import sys; from engine import LLM; LLM(sys.argv[1], num_blocks=8); "
            "print(sorted(m for m in ('sympy', 'transformers.activations', 'torch.distributed.tensor') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, str(tiny_llama)], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"

