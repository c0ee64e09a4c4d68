"""Weights that stay quantized: GGUF's Q4_0, Q4_1 and Q8_0 blocks, read from a .gguf as stored or
made at load from a float checkpoint (``--quantization int4 | int8``), multiplied by the native
kernel of csrc/cpu/quant_linear.h without ever being widened in memory.

A weight [N, K] is kept as uint8 [N, K / 32 * block_bytes]. It is loaded with each row as its
K / 32 blocks in GGUF's own layout (a .gguf tensor as stored; a fused projection, q/k/v or
gate/up, its parts' rows one after the other), then packed once, in place, into the kernel's
row layout: the same bytes, a row's integers first and its scales after (``to_kernel_rows``).
Activations stay in the model's dtype, and the KV cache too; a Q8_0 layer rounds its input to
Q8_0 blocks inside the kernel (as llama.cpp does: integer dot products, csrc/cpu/q8_dot.h), which
the dense fallback below does not (its fingerprint differs, so peers and stores keep them apart).

Where the native kernels cannot run (no AVX2, ENGINE_NATIVE=0, a CUDA device) the weights are
dequantized once at load into ordinary linears (the torch path), and the log says why.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("engine.worker")

QK = 32  # weights per block
# GGML's type ids, and each block's bytes: fp16 d [, fp16 m], then the integers.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
TYPE_IDS = {name: type_id for type_id, name in TYPE_NAMES.items()}
# --quantization: weight-only, group-wise over 32 input features. int4 is asymmetric (a scale
# and a minimum per group, Q4_1); int8 symmetric (a scale per group, Q8_0).
METHODS = {"int4": Q4_1, "int8": Q8_0}
# Part of the model fingerprint of a checkpoint quantized at load: bump it whenever quantize()
# rounds differently, so KV stored under the old rounding never matches.
QUANTIZER_VERSION = 1
# Part of the fingerprint of every model with quantized weights: bump it whenever the kernel's
# arithmetic changes (a KV store entry or a peer computed the old way must never match).
KERNEL_VERSION = 3
ROWS_AT_A_TIME = 4096  # quantize/dequantize whole tensors in slices: float32 temporaries stay small


def packed_shape(out_features: int, in_features: int, qtype: int) -> tuple[int, int]:
    if in_features % QK:
        raise ValueError(f"{TYPE_NAMES[qtype]} needs input features in multiples of {QK}, got {in_features}")
    return out_features, in_features // QK * BLOCK_BYTES[qtype]


# ---------------------------------------------------------------------------------------------
# The reference (pure torch): what the native kernels must equal, and the path without them.

def dequantize(blocks: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [N, K / 32 * block_bytes] -> [N, K] in ``dtype`` (computed in float32, as GGUF's
    own dequantization: w = d q, (q - 8) d or d q + m)."""
    if blocks.shape[0] > ROWS_AT_A_TIME:
        return torch.cat([dequantize(part, qtype, dtype) for part in blocks.split(ROWS_AT_A_TIME)])
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, groups, 1]
    if qtype == Q8_0:
        q = b[..., 2:].contiguous().view(torch.int8).float()
        w = q * d
    else:
        ints = b[..., 4:] if qtype == Q4_1 else b[..., 2:]
        q = torch.cat((ints & 15, ints >> 4), dim=-1).float()  # nibble j: low half of byte j, j+16: high
        w = q * d + b[..., 2:4].contiguous().view(torch.float16).float() if qtype == Q4_1 else (q - 8) * d
    return w.reshape(rows, -1).to(dtype)


def to_kernel_rows(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF's blocks [N, K / 32 * block_bytes] in the kernel's row layout (csrc/cpu/quant_linear.h):
    a row's integers, block after block, then its K / 32 fp16 scales d, then (Q4_1) its minimums."""
    rows, header = blocks.shape[0], 4 if qtype == Q4_1 else 2
    b = blocks.reshape(rows, -1, BLOCK_BYTES[qtype])
    parts = [b[..., header:], b[..., 0:2]] + ([b[..., 2:4]] if qtype == Q4_1 else [])
    return torch.cat([part.reshape(rows, -1) for part in parts], dim=1)


def from_kernel_rows(packed: torch.Tensor, qtype: int) -> torch.Tensor:
    """The inverse of ``to_kernel_rows``: GGUF's blocks again."""
    rows, header = packed.shape[0], 4 if qtype == Q4_1 else 2
    groups = packed.shape[1] // BLOCK_BYTES[qtype]
    ints_end = groups * (BLOCK_BYTES[qtype] - header)
    ints = packed[:, :ints_end].reshape(rows, groups, -1)
    scales = packed[:, ints_end:].reshape(rows, header // 2, groups, 2).transpose(1, 2).reshape(rows, groups, header)
    return torch.cat((scales, ints), dim=-1).reshape(rows, -1)


def pack_modules(model: nn.Module) -> None:
    """Every quantized module's blocks, once loaded, into the kernel's row layout, in place (a
    tied output layer shares the embedding's table: it is packed once)."""
    packed: set[int] = set()
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)) and id(module.weight) not in packed:
            packed.add(id(module.weight))
            for part in module.weight.data.split(ROWS_AT_A_TIME):
                part.copy_(to_kernel_rows(part, module.qtype))


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """A float weight [N, K] as blocks, rounded exactly as llama.cpp's reference quantizers (and
    gguf-py's port of them): Q8_0 scales each group by max|w| / 127, Q4_1 spans its [min, max]
    in 15 steps; the integers come from the float32 scale, which is then stored as fp16."""
    rows, cols = weight.shape
    packed_shape(rows, cols, qtype)
    if rows > ROWS_AT_A_TIME:
        return torch.cat([quantize(part, qtype) for part in weight.split(ROWS_AT_A_TIME)])
    w = weight.detach().float().reshape(rows, cols // QK, QK)
    if qtype == Q8_0:
        d = w.abs().amax(-1, keepdim=True) / 127
        v = w * torch.where(d > 0, 1 / d, 0.0)
        q = (v.sign() * (v.abs() + 0.5).floor()).to(torch.int8)  # roundf: halves away from zero
        return torch.cat((d.half().view(torch.uint8), q.view(torch.uint8)), dim=-1).reshape(rows, -1)
    if qtype != Q4_1:
        raise ValueError(f"quantizing to {TYPE_NAMES.get(qtype, qtype)} is not supported (Q4_1 or Q8_0)")
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = ((w - lo) * torch.where(d > 0, 1 / d, 0.0) + 0.5).to(torch.int8).clamp(max=15).to(torch.uint8)
    nibbles = q[..., :QK // 2] | (q[..., QK // 2:] << 4)
    return torch.cat((d.half().view(torch.uint8), lo.half().view(torch.uint8), nibbles), dim=-1).reshape(rows, -1)


# ---------------------------------------------------------------------------------------------
# Modules


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W as blocks. ``weight`` is a uint8 Parameter (so load_weights fills it
    like any other, part by part for fused projections, before pack_modules puts it in the
    kernel's row layout) that may be shared with an embedding."""

    def __init__(self, in_features: int, out_features: int, qtype: int, bias: bool, ops) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.weight = nn.Parameter(torch.empty(packed_shape(out_features, in_features, qtype), dtype=torch.uint8),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every row count runs the same kernel, whose rows never depend on each other's presence
        # (csrc/cpu/quant_linear.h): a prefill, a decode batch and a prefix-hit suffix give a
        # token bit-identical projections. (A dense GEMM above some row count would not.)
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if self.bias is not None and x.dtype != torch.float32:  # x W^T + b, rounded once (as nn.Linear)
            out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32, device=x.device)
            self.ops.quant_linear(out, rows.float(), self.weight, self.qtype)
            out = (out + self.bias.float()).to(x.dtype)
        else:
            out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            self.ops.quant_linear(out, rows, self.weight, self.qtype)
            if self.bias is not None:
                out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {TYPE_NAMES[self.qtype]}"


class QuantEmbedding(nn.Module):
    """An embedding table kept as blocks in the kernel's row layout (GGUF's token_embd, often tied
    to the output layer): the looked-up rows are dequantized."""

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding_dim, self.qtype, self.dtype = embedding_dim, qtype, dtype
        self.weight = nn.Parameter(torch.empty(packed_shape(num_embeddings, embedding_dim, qtype), dtype=torch.uint8),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = from_kernel_rows(self.weight[ids.reshape(-1)], self.qtype)
        return dequantize(rows, self.qtype, self.dtype).view(*ids.shape, self.embedding_dim)


def swap_modules(model: nn.Module, targets: dict[str, int], dtype: torch.dtype, ops) -> None:
    """Replaces the linears and embeddings that own the parameters named in ``targets`` (module
    path + ".weight" -> GGML type) with their quantized forms, on the meta device, before the
    model is materialized and loaded."""
    for param_name, qtype in targets.items():
        path, _, leaf = param_name.rpartition(".")
        if leaf != "weight":
            raise ValueError(f"only weights are quantized, not {param_name}")
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        old = getattr(parent, attr)
        if isinstance(old, nn.Linear):
            new = QuantLinear(old.in_features, old.out_features, qtype, old.bias is not None, ops)
        elif isinstance(old, nn.Embedding):
            new = QuantEmbedding(old.num_embeddings, old.embedding_dim, qtype, dtype)
        else:
            raise ValueError(f"{path} is a {type(old).__name__}: only linear and embedding weights are quantized")
        setattr(parent, attr, new)


def widen_modules(model: nn.Module, dtype: torch.dtype) -> None:
    """The torch path: every quantized module back to an ordinary one, its weight dequantized
    once (a tied output layer keeps sharing the embedding's table)."""
    widened: dict[int, nn.Parameter] = {}  # id(blocks) -> the dense weight, shared as the blocks were
    for name, module in list(model.named_modules()):
        if not isinstance(module, (QuantLinear, QuantEmbedding)):
            continue
        blocks = module.weight
        if id(blocks) not in widened:
            widened[id(blocks)] = nn.Parameter(dequantize(blocks.data, module.qtype, dtype), requires_grad=False)
        weight = widened[id(blocks)]
        if isinstance(module, QuantLinear):
            dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            dense.bias = module.bias
        else:
            dense = nn.Embedding(weight.shape[0], weight.shape[1], _weight=weight.data)
        dense.weight = weight
        parent_path, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_path), attr, dense)


def kernel_numerics(stored: dict[str, int] | None, method: str | None, dtype: torch.dtype,
                    device: torch.device) -> str:
    """The fingerprint's word on how this instance multiplies quantized weights: the kernel's
    version and ways (csrc/cpu/quant_linear.h for Q4 blocks: bf16 dot products, or float32 on an
    ISA's vectors; csrc/cpu/q8_dot.h for Q8_0: integer dot products by AVX512-VNNI or by AVX2's
    vpmaddubsw, whose float sums differ in order); "" without quantized weights or where they are dequantized at load (dense, as any
    float model: no kernel version to follow). KV computed one way is never handed to, or read
    back by, an instance computing another."""
    from engine.worker import native
    types = set((stored or {}).values()) | ({METHODS[method]} if method in METHODS else set())
    if not types:
        return ""
    isa = native._select()[0] if device.type == "cpu" else None
    if isa is None or not hasattr(native.load(isa), "quant_linear"):  # dense (model_runner._quantize)
        return ""
    ways = []
    if types & {Q4_0, Q4_1}:
        bf16_dot = isa == "avx512" and dtype == torch.bfloat16 and "avx512_bf16" in native.cpu_flags()
        ways.append("bf16dot" if bf16_dot else "f32")
    if Q8_0 in types:  # integer dot products, activations rounded to Q8_0 (csrc/cpu/q8_dot.h)
        ways.append("i8vnni" if isa == "avx512" and "avx512_vnni" in native.cpu_flags() else "i8madd")
    return f":qk{KERNEL_VERSION}-{isa}-{'-'.join(ways)}"


def quantized_targets(model: nn.Module, stored: dict[str, int] | None, method: str | None) -> dict[str, int]:
    """Parameter name -> GGML type of each weight the model keeps as blocks: those a converted
    .gguf stores as blocks (``stored``: checkpoint name -> type; None: not a .gguf), or with
    ``method`` (int4 | int8) every linear layer's and, when the output layer is tied to it, the
    embedding's."""
    tied = model.config.tie_word_embeddings
    if method in METHODS:
        if stored is not None:
            raise ValueError(f"quantization={method!r} quantizes a float checkpoint (a directory of safetensors); "
                             "a .gguf runs its Q4_0/Q4_1/Q8_0 tensors as stored and the others dequantized")
        qtype = METHODS[method]
        targets = {f"{name}.weight": qtype for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        return {**targets, "embed_tokens.weight": qtype} if tied else targets
    targets: dict[str, int] = {}
    for checkpoint_name, qtype in (stored or {}).items():
        name = model.checkpoint_name(checkpoint_name)
        if name is None or (tied and name == "lm_head.weight"):
            continue
        target = model.param_slot(name)[0]
        if targets.setdefault(target, qtype) != qtype:
            raise ValueError(f"{checkpoint_name} is {TYPE_NAMES[qtype]} but the rest of {target} is "
                             f"{TYPE_NAMES[targets[target]]}")
    if tied and "embed_tokens.weight" in targets:
        targets["lm_head.weight"] = targets["embed_tokens.weight"]  # one table, both ways
    return targets
