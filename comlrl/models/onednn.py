"""Linear layers on the CPU through oneDNN, for the lean decode and training forwards.

PyTorch runs fp32 `F.linear`/`mm` on the CPU through MKL's sgemm, and MKL takes its AVX-512 code
only on Intel processors: on AMD EPYC (measured on Zen 5) it runs the AVX2 code at about half the speed the
core can do. oneDNN, which PyTorch also ships (and already uses for bf16 products), runs AVX-512 on
any x86 CPU that has it. Measured on an AMD EPYC (Zen 5), one thread, 1024 x 256 -> 1024 fp32:
`F.linear` 5.4 ms, oneDNN 2.3-2.5 ms, and the same for the two backward products. oneDNN is used
on every CPU where PyTorch has it; on Intel CPUs, where MKL runs AVX-512 too, the two should be
close (not measured here).

Two entry points:

* `linear(x, weight, bias)`: an autograd-aware linear whose forward and backward products all run
  through oneDNN (fp32 CPU tensors, weights of at least `MIN_WEIGHT_ELEMENTS`; anything else
  goes to `F.linear`).
* `PackedLinear`: a weight reordered once into oneDNN's blocked layout, for the decode steps of a
  sampling call, which reuse each weight some 64 times with 8-32 rows. Without the reorder oneDNN
  (for bf16) reorders the weight on every call, and MKL (fp32) stays on AVX2: one medium-model
  decode step's projections, 16 rows, went from 1.40 to 0.92 ms in bf16 and 3.39 to 1.90 ms in fp32.

oneDNN sums in another order than MKL, so fp32 results differ from `F.linear` in the last bits
(~1e-6 relative); bf16 ones matched `F.linear` bitwise where checked (it runs oneDNN too). A row's
result does not depend on the number of rows in the call (tested), so a sample still does not
depend on the batch it is decoded in.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        return (torch.backends.mkldnn.is_available() and mkldnn is not None
                and hasattr(mkldnn, "_linear_pointwise") and hasattr(mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


AVAILABLE = _available()

#: Weights with fewer elements stay on `F.linear`: fp32 ones on MKL, bf16 ones unpacked. oneDNN
#: keeps a generated kernel per product shape (on the order of 1 MB of memory each), and a packed
#: weight's calls go through its primitive machinery; for small weights the speed it buys does not
#: pay for that. Small tiny model (hidden 64), MAGRPO run: fp32 0.76 s and 485 MB peak through
#: oneDNN, 0.70 s and 472 MB through MKL; bf16 with every weight packed for decoding 1.11-1.15 s,
#: with small weights unpacked 0.67-0.74 s (same peak).
MIN_WEIGHT_ELEMENTS = 256 * 256


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _large_on_cpu(weight: torch.Tensor) -> bool:
    """Whether products with `weight` are worth sending through oneDNN (see `MIN_WEIGHT_ELEMENTS`)."""
    return AVAILABLE and weight.device.type == "cpu" and weight.numel() >= MIN_WEIGHT_ELEMENTS


class _Linear(torch.autograd.Function):
    """y = x W^T + b with all three products (forward, input and weight gradients) in oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(grad, weight.t(), None)  # grad @ W
        if ctx.needs_input_grad[1]:
            grad_weight = _onednn_linear(grad.t(), x.t(), None)  # grad^T @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(dim=0)
        return grad_x, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN for fp32 CPU tensors (forward and backward)."""
    if (not _large_on_cpu(weight) or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32)):
        return F.linear(x, weight, bias)
    if x.dim() == 2:
        return _Linear.apply(x, weight, bias)
    shape = x.shape
    return _Linear.apply(x.reshape(-1, shape[-1]), weight, bias).view(*shape[:-1], weight.shape[0])


class PackedLinear:
    """A frozen linear layer for inference: on the CPU its weight is reordered once into oneDNN's
    blocked layout (a copy); elsewhere, and for weights under `MIN_WEIGHT_ELEMENTS`, it keeps the
    weight as it is and calls `F.linear`."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        self.out_features = weight.shape[0]
        self.packed = _large_on_cpu(weight) and weight.dtype in (torch.float32, torch.bfloat16)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if self.packed else weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, in) -> (rows, out)."""
        if self.packed:
            return _onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
