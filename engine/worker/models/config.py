"""What the engine needs to know about a model, read from its HF ``config.json`` by the family's
``config_from_hf`` (one per file in this package). Family-neutral: a field a family does not use
keeps its default."""
from __future__ import annotations

from dataclasses import dataclass, field

# rope_factors: per-frequency divisors (how llama.cpp stores llama3 scaling in a GGUF; LongRoPE's
# short factors), with an optional attention_factor multiplying cos and sin.
ROPE_TYPES = ("default", "linear", "llama3", "rope_factors")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Sliding window of each layer, None for global attention (Gemma alternates the two).
    layer_windows: tuple[int | None, ...] = field(default=())
    # Rope base of the sliding layers when it differs from the global one (Gemma 3), unscaled.
    local_rope_theta: float | None = None
    rotary_dim: int | None = None  # rotate only the first rotary_dim of each head (Phi partial rotary)
    qk_norm: bool = False  # an RMSNorm over each query and key head before rope (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # of the gated MLP: silu, or gelu_pytorch_tanh (Gemma)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)
    final_softcap: float | None = None  # ... and of the logits

    @property
    def attention_windows(self) -> list[int | None]:
        """The distinct sliding windows of the layers (None: global), in a fixed order."""
        return sorted(set(self.layer_windows), key=lambda w: -1 if w is None else w)


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling or None) from either config form: top-level ``rope_theta`` and
    ``rope_scaling`` (configs on the Hub), or ``rope_parameters`` (transformers >= 5)."""
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or rope
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    return theta, (scaling if rope_type != "default" else None)


def check_activation(cfg: dict, key: str, supported: tuple[str, ...]) -> str:
    act = cfg.get(key) or supported[0]
    if act not in supported:
        raise ValueError(f"unsupported {key} {act!r}; supported: {', '.join(supported)}")
    return act


def base_config(cfg: dict, arch: str, **family) -> ModelConfig:
    """The fields every family reads the same way, plus the family's own."""
    num_heads = cfg["num_attention_heads"]
    theta, scaling = family.pop("rope", None) or rope_settings(cfg)
    values = dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        layer_windows=(None,) * cfg["num_hidden_layers"],
    )
    values.update(family)
    return ModelConfig(**values)


def windows_from_layer_types(cfg: dict, window: int | None, default_types: list[str]) -> tuple[int | None, ...]:
    """Per-layer windows from ``layer_types`` ("sliding_attention" / "full_attention"), or from
    ``default_types`` when the config predates that key."""
    types = cfg.get("layer_types") or default_types
    if len(types) != cfg["num_hidden_layers"]:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {cfg['num_hidden_layers']}")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported layer_types {sorted(unknown)}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def qwen_layer_windows(cfg: dict) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: a sliding window only with ``use_sliding_window``, and then on the layers
    from ``max_window_layers`` up (transformers' rule), unless ``layer_types`` says otherwise."""
    layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    if window is None:
        return (None,) * layers
    first = cfg.get("max_window_layers", layers)
    default = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return windows_from_layer_types(cfg, window, default)
