"""The default model's weights as a float32 safetensors checkpoint, for benchmarks whose other side
reads only float checkpoints (vLLM, transformers) or that measure the dense float path.

The engine runs the .gguf's Q4_1/Q8_0 tensors as stored (docs/quantization.md), so its converted
directory holds quantized blocks that vLLM and transformers cannot read. This is the .gguf
dequantized by transformers' own GGUF reader, made once and cached under the engine's cache
directory ($ENGINE_CACHE_DIR/benchmarks).
"""
from __future__ import annotations

import shutil
from pathlib import Path


def default_float_checkpoint() -> Path:
    from engine.worker.loader import _cache_root, default_model_path, resolve_model
    gguf_path = default_model_path()
    return float_checkpoint(gguf_path, resolve_model(None), _cache_root() / "benchmarks" / f"{gguf_path.stem}-float32")


def float_checkpoint(gguf_path: Path, converted: Path, out: Path) -> Path:
    """``gguf_path`` dequantized to float32 at ``out`` (config and tokenizer from ``converted``)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(converted), dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    model.tie_weights()
    tmp = out.with_name(f"{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(converted / name, tmp / name)
    tmp.rename(out)
    return out
