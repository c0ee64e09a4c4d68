"""oneDNN-packed linear layers for CPU inference.

torch's default CPU matmul (MKL) is 1.5-2.5x slower than oneDNN with weights reordered once
into its blocked layout, for every batch size this engine sees (1 to a few thousand rows).
Results agree to float rounding (~1e-6 relative), like any other GEMM blocking. bfloat16 is
packed wherever oneDNN supports it (AVX-512 and up; native kernels with AVX512-BF16 or AMX):
measured on AMX, 1.3-2x faster than torch's bf16 matmul for up to a few dozen rows (decode
batches), on par above, +4-13% end to end.

Steps of up to SMALL_ROWS rows (a few streams decoding) in bfloat16 on a CPU with AVX512-BF16
can instead read a plain copy of the weight with the native small_rows_linear kernel
(csrc/cpu/small_rows_linear.h): such steps are bound by reading the weights, which oneDNN's
packed GEMM does at about half the machine's rate. The copy costs the weight's size again, and
a row's bits then depend on whether its step had up to SMALL_ROWS rows (oneDNN's rows, measured
on SmolLM2's shapes, do not depend on the step), so it is kept only when asked for
(EngineConfig.small_rows_linear).
"""
from __future__ import annotations

import torch
from torch import nn

SMALL_ROWS = 4  # csrc/cpu/small_rows_linear.h: kSmallRows


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or not hasattr(
            torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W kept only in oneDNN's reordered layout (inference only)."""

    def __init__(self, linear: nn.Linear, small_rows_ops=None) -> None:
        """small_rows_ops: the native kernels (torch.ops.engine_avx512) when steps of up to
        SMALL_ROWS rows read a plain copy of the weight with small_rows_linear (bfloat16, no
        bias); the copy is the module's weight tensor itself (shared with a tied embedding)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.small_rows_ops = small_rows_ops if self.bias is None and weight.dtype == torch.bfloat16 else None
        self.small_weight = weight if self.small_rows_ops is not None else None
        self.pair_single_rows = single_row_differs(self.packed_weight, self.out_features, self.in_features,
                                                   weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.small_weight is not None and x.dim() == 2 and x.shape[0] <= SMALL_ROWS and x.stride(-1) == 1
                and x.dtype == torch.bfloat16):
            out = x.new_empty(x.shape[0], self.out_features)
            self.small_rows_ops.small_rows_linear(out, x, self.small_weight)
            return out
        if self.pair_single_rows and x.dim() == 2 and x.shape[0] == 1:
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), self.packed_weight, self.bias,
                                                      "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def single_row_differs(packed_weight: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether oneDNN computes a step of one row of this shape in other bits than the same row
    in a larger step. It takes another path for a single row, which on a 2-core Zen 4 VM changed
    most outputs of a 576 x 1536 fp32 layer (SmolLM2's down projection) in their last bit and left
    its 576-wide ones alone; a row's result must not depend on its step (outputs must not change
    with batching). Probed once per shape and dtype (on the first such layer's weight, random
    rows); where it differs, a single row is computed as two (itself twice: +20% on such a
    layer's time), here and in csrc/cpu/decoder.h."""
    key = (out_features, in_features, dtype)
    if key not in _SINGLE_ROW_DIFFERS:
        x = torch.randn(PROBE_ROWS, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        together = torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")
        _SINGLE_ROW_DIFFERS[key] = any(
            not torch.equal(torch.ops.mkldnn._linear_pointwise(x[i:i + 1], packed_weight, None, "none", [], ""),
                            together[i:i + 1]) for i in range(PROBE_ROWS))
    return _SINGLE_ROW_DIFFERS[key]


PROBE_ROWS = 32
_SINGLE_ROW_DIFFERS: dict[tuple[int, int, torch.dtype], bool] = {}


def pack_linears(module: nn.Module, small_rows_ops=None) -> None:
    """Replace every nn.Linear below `module` with a PackedLinear, in place (see PackedLinear
    for small_rows_ops)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child, small_rows_ops))
        else:
            pack_linears(child, small_rows_ops)


def small_rows_candidates(module: nn.Module) -> tuple[int, int]:
    """(how many nn.Linear below `module` could take the small-rows kernel: bias-free, bfloat16;
    the bytes their plain copies add). A weight that is also another module's parameter (a tied
    embedding) adds none."""
    linears = [m for m in module.modules()
               if isinstance(m, nn.Linear) and m.bias is None and m.weight.dtype == torch.bfloat16]
    others = {id(p) for m in module.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    distinct = {id(m.weight): m.weight for m in linears if id(m.weight) not in others}
    return len(linears), sum(w.numel() * w.element_size() for w in distinct.values())
