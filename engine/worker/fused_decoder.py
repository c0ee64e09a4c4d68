"""A decoder's layers in one native call (csrc/cpu/decoder.h ``decoder_layers``) instead of a
Python loop over modules: the same kernels on the same tensors in the same order, so the same
bits, minus ~10 op calls' worth of Python and dispatch per layer. That host work was a third of
a single-stream decode step of the default model (docs/performance.md).

``fuse(model, kernels)`` returns a ``FusedDecoder`` for the models whose layers are exactly what
the native call runs (Llama's decoder on the native CPU kernels: no biases, no q/k norms, one
rope, linears quantized or oneDNN-packed), else None; those models keep the module loop.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from engine.worker.backends.cpu import CpuNativeBackend
from engine.worker.cpu_linear import PackedLinear
from engine.worker.ops import ACTIVATIONS, NativeOps
from engine.worker.quantized import QuantLinear

logger = logging.getLogger("engine.worker")

# decoder.h's linear kinds besides a GGML block type (QuantLinear's): a PackedLinear's oneDNN
# weight, and an nn.Linear's (where oneDNN does not pack this dtype).
ONEDNN, TORCH, ONEDNN_PAIRED = -1, -2, -3  # ONEDNN_PAIRED: a single row computed as two (cpu_linear.py)
_NO_WEIGHT = torch.empty(0, dtype=torch.bfloat16)  # decoder_layers' small_weights entry of a linear without one


def _linear(module: nn.Module) -> tuple[torch.Tensor, int] | None:
    """(weight, kind) of a linear layer decoder_layers computes as its module would; None: it
    cannot (a bias)."""
    if getattr(module, "bias", None) is not None:
        return None
    if isinstance(module, QuantLinear):
        return module.weight, module.qtype
    if isinstance(module, PackedLinear):
        return module.packed_weight, ONEDNN_PAIRED if module.pair_single_rows else ONEDNN
    if type(module) is nn.Linear:
        return module.weight, TORCH
    return None


def _why_not(model: nn.Module, kernels) -> str | None:
    from engine.worker.models.layers import RMSNorm
    from engine.worker.models.llama import DecoderLayer
    if not isinstance(kernels.ops, NativeOps) or not isinstance(kernels.attention, CpuNativeBackend):
        return "the layers run on torch's kernels"
    cfg = model.config
    if cfg.qk_norm or cfg.attn_softcap or cfg.local_rope_theta is not None or cfg.hidden_act not in ACTIVATIONS:
        return "q/k norms, soft-capping or a second rope"
    for layer in model.layers:
        if type(layer) is not DecoderLayer or not all(
                type(norm) is RMSNorm for norm in (layer.input_layernorm, layer.post_attention_layernorm)):
            return f"its layers are {type(layer).__name__}"
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if any(_linear(m) is None for m in linears):
            return "its linear layers have biases"
    return None


class FusedDecoder:
    """Runs ``model.layers`` as decoder_layers does; built once the model is loaded and packed
    (it holds the layers' weight tensors, not copies)."""

    def __init__(self, model: nn.Module, kernels) -> None:
        cfg = model.config
        self.k = kernels.ops.k
        self.weights: list[torch.Tensor] = []
        self.kinds: list[int] = []
        # Each linear's small-rows weight (PackedLinear.small_weight), or an empty tensor where it
        # has none (a quantized linear beside dequantized ones in one .gguf).
        small: list[torch.Tensor] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            small += [w if (w := getattr(m, "small_weight", None)) is not None else _NO_WEIGHT for m in modules]
            linears = [_linear(m) for m in modules]
            self.weights += [layer.input_layernorm.weight, linears[0][0], linears[1][0],
                             layer.post_attention_layernorm.weight, linears[2][0], linears[3][0]]
            self.kinds += [kind for _, kind in linears]
        self.small_weights = small if any(w.numel() for w in small) else []
        self.windows = [layer.self_attn.window or 0 for layer in model.layers]
        self.first_norm = model.layers[0].input_layernorm
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.eps, self.scale = cfg.rms_norm_eps, model.layers[0].self_attn.scale
        self.act = ACTIVATIONS.index(cfg.hidden_act)

    def __call__(self, h: torch.Tensor, rope: dict, kv_caches: torch.Tensor,
                 metas: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream) from the embeddings ``h``, as the
        module loop returns them."""
        x, residual = self.first_norm.add_norm(h, None)
        cos, signed_sin = rope["global"]
        meta = next(iter(metas.values()))  # the windows' metadata differ only in their window
        out = self.k.decoder_layers(x, residual, self.weights, self.kinds, self.small_weights, self.windows,
                                    cos.view(cos.shape[0], -1), signed_sin.view(cos.shape[0], -1), kv_caches,
                                    meta.slot_mapping, meta.block_table, meta.query_start, meta.seq_lens,
                                    self.num_heads, self.num_kv_heads, self.eps, self.scale, self.act)
        return out, residual


def fuse(model: nn.Module, kernels) -> FusedDecoder | None:
    """The model's layers as one native call, or None (with the reason in the log) where the
    module loop must run them."""
    if not hasattr(kernels.ops, "k") or not hasattr(kernels.ops.k, "decoder_layers"):
        return None
    if not hasattr(kernels.ops.k, "small_rows_linear"):  # came with decoder_layers' current schema
        logger.warning("decoder layers run one module at a time: the native build predates this engine's "
                       "decoder_layers (pip install --no-build-isolation -e .)")
        return None
    why = _why_not(model, kernels)
    if why is not None:
        logger.info("decoder layers run one module at a time: %s", why)
        return None
    return FusedDecoder(model, kernels)
