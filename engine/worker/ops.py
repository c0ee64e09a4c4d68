"""The layer ops a decoder runs between its GEMMs, two ways with one meaning:

- ``TorchOps``: plain torch, the reference (and the path on CUDA, and wherever the native
  kernels cannot run);
- ``NativeOps``: csrc/cpu's fused kernels (engine/worker/native.py), one call where torch
  runs several, rounding to the model's dtype wherever the torch code rounds.

The runner picks one per model (NativeOps with the native "cpu" attention backend) and the
model's layers call it; tests check the two against each other on generated shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class TorchOps:
    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
        """Llama: weight * cast(x / rms(x)); Gemma: cast(x / rms(x) * (1 + weight)), in float32."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        if gemma:
            return (y * (1.0 + weight.float())).to(x.dtype)
        return weight * y.to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x); with no residual yet, x is the residual."""
        residual = x if residual is None else residual + x
        return cls.rms_norm(residual, weight, eps, gemma), residual

    @staticmethod
    def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
        """act(gate) * up for x = [gate | up] along the last dim."""
        gate, up = x.chunk(2, dim=-1)
        gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
        return gate * up

    @staticmethod
    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit, in three kernels instead of six:
    rotate_half(x) = cat(-x2, x1) = roll(x, half) with the sign folded into ``signed_sin``
    (= cat(-sin1, sin2), from rope_for_positions). With partial rotary, only the first
    cos.shape[-1] dims of each head turn."""
    # x: [num_tokens, heads, head_dim]; cos, signed_sin: [num_tokens, 1, rotary_dim]
    dim = cos.shape[-1]
    if dim != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :dim], cos, signed_sin), x[..., dim:]), dim=-1)
    return x * cos + x.roll(dim // 2, dims=-1) * signed_sin


class NativeOps:
    """The same ops on csrc/cpu's kernels (CPU tensors of float32, bfloat16 or float16)."""
    name = "native"

    def __init__(self, kernels) -> None:
        self.k = kernels  # torch.ops.engine_<isa>

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # q/k head norms: [tokens * heads, head_dim]
        out = torch.empty(rows.shape, dtype=x.dtype)
        self.k.rms_norm(out, rows, weight, eps, int(gemma))
        return out.view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # In place: x (a layer's fresh output) becomes the normed input of the next, residual
        # the running sum. The first layer's residual is its input itself.
        if residual is None:
            return self.rms_norm(x, weight, eps, gemma), x
        self.k.add_rms_norm(x, residual, weight, eps, int(gemma))
        return x, residual

    def act_and_mul(self, x: torch.Tensor, act: str) -> torch.Tensor:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        self.k.act_and_mul(out, x, ACTIVATIONS.index(act))
        return out

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # In place, on views of the fused qkv projection's output.
        self.k.rope(q, k, cos.view(cos.shape[0], -1), signed_sin.view(cos.shape[0], -1))
        return q, k


@dataclass(frozen=True, slots=True)
class Kernels:
    """What a model runs on: an attention backend and the layer ops that go with it."""
    attention: object
    ops: TorchOps | NativeOps
