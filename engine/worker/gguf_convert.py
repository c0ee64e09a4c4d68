"""A GGUF file (llama.cpp's format) turned into an HF-style directory the engine loads: config.json,
tokenizer files, generation_config.json and one model.safetensors. Tensors in the block formats
the native kernels multiply as stored (Q4_0, Q4_1, Q8_0) are kept as their raw blocks (uint8, one
row of blocks per output feature) and listed in engine-gguf-blocks.json; the others (F32/F16/BF16
tensors, K-quants and the other GGUF types) are dequantized to float32.

Tensor names come from gguf-py's own map of each architecture (the table llama.cpp's converter
wrote them with), read backwards. What llama.cpp's converter changed on the way in is undone:
Llama's q/k rows are permuted for its rope kernel, and Gemma's RMSNorm weights are stored as
(1 + w). transformers reads the config and the tokenizer; the Gemma settings it does not read
from a GGUF (soft-capping, rope scaling, the attention scale) are taken from the file here.
"""
from __future__ import annotations

import json
from pathlib import Path

# GGUF architecture -> HF class. llama.cpp stores Mistral models as "llama"; transformers tells
# them apart by general.name and gives model_type "mistral".
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                    "phi3": "Phi3ForCausalLM"}
SUPPORTED = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# HF module names of a decoder layer, for the reverse lookup through gguf-py's map.
_LAYER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "self_attn.qkv_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
                  "mlp.down_proj", "mlp.gate_up_proj", "input_layernorm", "post_attention_layernorm",
                  "pre_feedforward_layernorm", "post_feedforward_layernorm")
_FUSED = ("self_attn.qkv_proj", "mlp.gate_up_proj")
_GLOBAL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
# llama.cpp's per-frequency rope divisors (Llama 3.1+ "llama3" scaling): not a parameter; they go
# into the config (rope_type "rope_factors") and the engine divides the frequencies by them.
_ROPE_FACTORS = "rope_freqs.weight"


def convert(gguf_path: Path, out_dir: Path, metadata: dict[str, str]) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    if arch not in SUPPORTED:
        raise ValueError(f"GGUF architecture {arch!r} in {gguf_path} is not supported "
                         f"(supported: {', '.join(SUPPORTED)})")

    if any(t.name.startswith("rope_factors_") for t in reader.tensors):
        raise ValueError(f"{gguf_path}: LongRoPE GGUF files (Phi-3.5, Phi-4-mini, Phi-3 128k) are not supported; "
                         "load the Hugging Face checkpoint instead (served up to its original context)")
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config.architectures = [HF_ARCHITECTURES[config.model_type if config.model_type == "mistral" else arch]]
    config.dtype = torch.float32
    tensor_names = {t.name for t in reader.tensors}
    config.tie_word_embeddings = "output.weight" not in tensor_names
    config.save_pretrained(out_dir)
    # transformers 5 writes `dtype` and nests rope settings in rope_parameters; add the older
    # top-level keys too so readers of either convention see the same model.
    config_json = json.loads((out_dir / "config.json").read_text())
    config_json["torch_dtype"] = "float32"
    if (rope_theta := (config_json.get("rope_parameters") or {}).get("rope_theta")) is not None:
        config_json.setdefault("rope_theta", rope_theta)
    config_json.update(_settings_transformers_skips(reader, arch, config_json))
    factors = next((t for t in reader.tensors if t.name == _ROPE_FACTORS), None)
    if factors is not None:
        if config_json.get("rope_scaling") or arch != "llama":
            raise ValueError(f"{gguf_path}: rope_freqs together with other rope scaling is not supported")
        divisors = gguf.quants.dequantize(factors.data, factors.tensor_type).astype("float64").reshape(-1)
        config_json["rope_scaling"] = {"rope_type": "rope_factors", "factors": [float(x) for x in divisors]}
        config_json.pop("rope_parameters", None)
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # Inline the chat template into tokenizer_config.json (readable by any tokenizer loader)
    # instead of transformers 5's separate chat_template.jinja.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    if "tokenizer.chat_template" in reader.fields:
        saved = json.loads((out_dir / "tokenizer_config.json").read_text())
        if not saved.get("chat_template"):
            raise RuntimeError(f"The chat template of {gguf_path} was lost in tokenizer conversion")

    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    hf_names = _hf_names(gguf, arch, config.num_hidden_layers)
    named = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FACTORS:
            continue
        base, _, suffix = tensor.name.rpartition(".")  # suffix: weight | bias
        if base not in hf_names:  # refuse rather than silently drop a weight the model may need
            raise ValueError(f"GGUF tensor {tensor.name!r} has no known HF name for architecture {arch!r}")
        named[f"{hf_names[base]}.{suffix}"] = tensor
    kept = _kept_quantized(named)
    tensors = {}
    for name, tensor in named.items():
        # GGUF lists dimensions fastest-first; numpy/HF order is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if name in kept:  # one row of blocks per output feature
            weights = torch.from_numpy(tensor.data.reshape(shape[0], -1).copy())
        else:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype("float32", copy=False)
            weights = torch.from_numpy(weights.reshape(shape).copy())
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weights = _unpermute_rope(weights, config.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weights = _unpermute_rope(weights, config.num_key_value_heads)
        elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            weights = weights - 1  # llama.cpp stores Gemma's (1 + w)
        tensors[name] = weights
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt", **metadata})
    # Every tensor's GGUF type, and which are kept as blocks (the rest are float32 here).
    manifest = {"format": "gguf", "source": str(gguf_path), "tensors": dict(sorted(kept.items())),
                "source_types": {name: t.tensor_type.name for name, t in sorted(named.items())}}
    (out_dir / QUANTIZATION_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


QUANTIZATION_FILE = "engine-gguf-blocks.json"  # a name only this engine writes
# The projections the engine fuses into one matrix: their parts must share a block type to stay
# quantized together (else all of them are dequantized).
_FUSED_PARTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _kept_quantized(named: dict) -> dict[str, str]:
    """HF name -> GGML type name of the weights kept as stored blocks."""
    from engine.worker.quantized import TYPE_IDS
    types = {name: t.tensor_type.name for name, t in named.items() if name.endswith(".weight") and len(t.shape) == 2}
    fused: dict[tuple[str, str], list[str]] = {}  # (layer, fused projection) -> its parts
    for name in types:
        layer, _, module = name.removesuffix(".weight").rpartition(".")
        if module in _FUSED_PARTS:
            fused.setdefault((layer, _FUSED_PARTS[module]), []).append(name)
    mixed = {part for parts in fused.values() if len({types[p] for p in parts}) > 1 for part in parts}
    return {name: t for name, t in types.items() if t in TYPE_IDS and name not in mixed}


def _hf_names(gguf, arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor base name -> HF name, through gguf-py's map for ``arch``."""
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), num_layers)
    # Phi-3's checkpoints fuse q/k/v and gate/up, and its ffn_up is the fused pair: try those first.
    modules = sorted(_LAYER_MODULES, key=lambda m: m not in _FUSED) if arch == "phi3" else _LAYER_MODULES
    candidates = [*_GLOBAL_MODULES, *(f"model.layers.{i}.{m}" for i in range(num_layers) for m in modules)]
    out = {}
    for hf_name in candidates:
        gguf_name = name_map.get_name(hf_name)
        if gguf_name is not None:
            out.setdefault(gguf_name, hf_name)
    return out


def _settings_transformers_skips(reader, arch: str, config: dict) -> dict:
    """Config keys transformers leaves at their defaults when it reads a GGUF, from the file."""
    def field(key: str):
        item = reader.fields.get(f"{arch}.{key}")
        return None if item is None else item.contents()

    out = {}
    if (head_dim := field("attention.key_length")) is not None:
        out["head_dim"] = int(head_dim)
    scaling = field("rope.scaling.type")
    if scaling not in (None, "none", "linear"):  # e.g. yarn: refused rather than run without it
        raise ValueError(f"GGUF rope scaling {scaling!r} ({arch}) is not supported; supported: linear")
    if scaling == "linear" and arch != "gemma3":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
        out["rope_parameters"] = {**(config.get("rope_parameters") or {}), **out["rope_scaling"]}
    if arch == "phi3":
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        if (rotary := field("rope.dimension_count")) is not None and rotary != head_dim:
            out["partial_rotary_factor"] = rotary / head_dim  # also where transformers 5 keeps it:
            out["rope_parameters"] = {**(config.get("rope_parameters") or {}), "partial_rotary_factor": rotary / head_dim}
        out["sliding_window"] = field("attention.sliding_window")
    if arch not in ("gemma2", "gemma3"):
        return out
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = out.get("head_dim", config.get("head_dim") or hidden // heads)
    # llama.cpp's rule: the 27B models scale attention by hidden/heads, the others by head_dim.
    is_27b = config["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
    out["query_pre_attn_scalar"] = hidden // heads if is_27b else head_dim
    out["sliding_window"] = field("attention.sliding_window") or config.get("sliding_window")
    if arch == "gemma2":
        out["attn_logit_softcapping"] = field("attn_logit_softcapping")
        out["final_logit_softcapping"] = field("final_logit_softcapping")
    elif field("rope.scaling.type") == "linear":  # gemma3 4B and up: the global layers' rope
        scaling = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
        per_type = config.get("rope_parameters") or {}
        if "full_attention" in per_type:
            out["rope_parameters"] = {**per_type, "full_attention": {**per_type["full_attention"], **scaling}}
        else:
            out["rope_scaling"] = scaling
    return out


def _unpermute_rope(w, n_head: int):
    # llama.cpp's converter stores each head's rows as (2, head_dim/2) halves interleaved into
    # (head_dim/2, 2) pairs for its rope kernel; swap them back to HF's rotate-half layout.
    # Same as transformers' LlamaTensorProcessor._reverse_permute_weights.
    # w: [n_head * head_dim, in] (or [n_head * head_dim] for a bias)
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
