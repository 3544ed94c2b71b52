"""Linear layers on the CPU through oneDNN, for the lean decode and training forwards.

PyTorch runs fp32 `F.linear`/`mm` on the CPU through MKL's sgemm, and MKL takes its AVX-512 code
only on Intel processors: on AMD EPYC (measured on Zen 5) it runs the AVX2 code at about half the speed the
core can do. oneDNN, which PyTorch also ships (and already uses for bf16 products), runs AVX-512 on
any x86 CPU that has it. Measured on an AMD EPYC (Zen 5), one thread, 1024 x 256 -> 1024 fp32:
`F.linear` 5.4 ms, oneDNN 2.3-2.5 ms, and the same for the two backward products. On a CPU without
AVX-512 both run AVX2 code and MKL is the faster one (measured on an AVX2-only AMD EPYC (Zen 3),
fp32: 16 x 256 -> 768 products 138 us through MKL against 157-187 us through oneDNN, weight
gradients of 1024-row chunks 5.1 ms against 7.9 ms), so fp32 products go through oneDNN only where
PyTorch runs AVX-512 code on a CPU that is not Intel's (`FP32_THROUGH_ONEDNN`). On an Intel Xeon
with AVX-512, MKL runs its AVX-512 code and was the faster at every training shape measured (1056
tokens, one thread: 256 -> 1024 forward 3.44 -> 2.94 ms, weight gradient 4.35 -> 3.42 ms; 512 ->
256 weight gradient 1.90 -> 1.62 ms), and takes transposed operands without the copies oneDNN's
weight gradients make: a medium-model 1056-token log-prob forward + backward 191 -> 182 ms.

Two entry points:

* `forward`, `grad_input`, `grad_weight`: the three products of a linear layer (for the lean
  training forward's autograd functions, `comlrl.models.training_ops`), through oneDNN for fp32
  CPU tensors and weights of at least `MIN_WEIGHT_ELEMENTS`; anything else goes to `F.linear` and
  `mm`, as autograd's own linear would run it.
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

from ..precision import cpu_has_native_bf16


def _available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        return (torch.backends.mkldnn.is_available() and mkldnn is not None
                and hasattr(mkldnn, "_linear_pointwise") and hasattr(mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


AVAILABLE = _available()


def cpu_capability() -> str:
    """The vector code PyTorch runs on this CPU ("AVX2", "AVX512", ...; "" where it cannot say)."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return ""


def _avx512() -> bool:
    return cpu_capability().startswith("AVX512")


def _intel() -> bool:
    """Whether the CPU is Intel's (MKL runs its AVX-512 code there), from /proc/cpuinfo; False
    where that cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("vendor_id"):
                    return "GenuineIntel" in line
    except OSError:
        pass
    return False


#: Whether fp32 products go through oneDNN rather than MKL: where the CPU has AVX-512 and is not
#: Intel's (see above).
FP32_THROUGH_ONEDNN = AVAILABLE and _avx512() and not _intel()

#: Whether oneDNN has native bf16 kernels on this CPU (AVX512-BF16, AMX, or at least AVX-512 or
#: AVX-NE-CONVERT to emulate them). Without them it refuses to pack a bf16 weight, and bf16 products
#: run on PyTorch's reference kernels (an AVX2-only AMD EPYC, for one).
BF16_AVAILABLE = AVAILABLE and cpu_has_native_bf16()

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


def _through_onednn(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of `a` with `weight` (fp32 CPU tensors, large weight) runs in oneDNN;
    everything else keeps PyTorch's own kernels (bf16 ones run oneDNN there already)."""
    return (FP32_THROUGH_ONEDNN and _large_on_cpu(weight) and a.device.type == "cpu"
            and a.dtype == torch.float32 and weight.dtype == torch.float32)


def forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x W^T + b for 2-D x, no autograd: the forward product of a linear layer."""
    if _through_onednn(x, weight) and (bias is None or bias.dtype == torch.float32):
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def grad_input(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad W: a linear layer's input gradient (2-D grad)."""
    if _through_onednn(grad, weight):
        return _onednn_linear(grad, weight.t(), None)
    return grad.mm(weight)


def grad_weight(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad^T x: a linear layer's weight gradient (2-D grad and x), through oneDNN when the
    forward product with `weight` is."""
    if _through_onednn(grad, weight):
        return _onednn_linear(grad.t(), x.t(), None)
    return grad.t().mm(x)


class PackedLinear:
    """A frozen linear layer for inference: on the CPU its weight is reordered once into oneDNN's
    blocked layout (a copy) where oneDNN runs that dtype's products (`FP32_THROUGH_ONEDNN`,
    `BF16_AVAILABLE`); elsewhere, for weights under `MIN_WEIGHT_ELEMENTS`, and with `pack=False`
    (the caller has a faster kernel for them), it keeps the weight as it is and calls `F.linear`."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, pack: bool = True):
        self.out_features = weight.shape[0]
        self.packed = pack and _large_on_cpu(weight) and (
            (weight.dtype == torch.float32 and FP32_THROUGH_ONEDNN) or (weight.dtype == torch.bfloat16 and BF16_AVAILABLE))
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if self.packed else weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, in) -> (rows, out)."""
        if self.packed:
            return _onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
