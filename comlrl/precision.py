"""Mixed precision: which dtype the matrix products of sampling and of the loss run in.

Weights, gradients and optimizer state stay in the model's own dtype (fp32 for the default models),
so small learning-rate updates are not rounded away; only the products run in bf16 (autocast). That
is the usual recipe for RL fine-tuning on GPUs, and on CPUs with native bf16 dot products
(AVX512-BF16 / AMX) it pays there too at real model sizes (Qwen2.5-0.5B's shape on a Zen 4 EPYC:
sampling 1.7x, update 1.35x); on tiny models the fp32 C decode kernels are the faster.

* ``"no"``   -- run everything in the model's dtype.
* ``"bf16"`` -- bf16 products wherever the device can run them (any CPU, CUDA with bf16 support).
  A CPU without native bf16 instructions (no AVX-512 or AMX: an AVX2-only AMD EPYC, say) runs
  them on PyTorch's reference kernels, several times slower than fp32; a warning says so.
* ``"auto"`` -- bf16 on CUDA devices that support it, the model's dtype elsewhere. The CPU stays
  exact by default because bf16 changes the numbers a run produces; opt in there with ``"bf16"``.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional

import torch

MIXED_PRECISION_MODES = ("auto", "no", "bf16")


def compute_dtype(setting: str, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype for `device` under `setting`, or None for the model's own dtype."""
    if setting not in MIXED_PRECISION_MODES:
        raise ValueError(f"mixed_precision must be one of {list(MIXED_PRECISION_MODES)}, got {setting!r}.")
    device = torch.device(device)
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if setting == "no" or (setting == "auto" and not cuda_bf16):
        return None
    if device.type == "cuda" and not cuda_bf16:
        raise ValueError(f"mixed_precision='bf16' but {device} has no bf16 support; use 'no' or 'auto'.")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"mixed_precision='bf16' is supported on cpu and cuda devices, not {device.type}; use 'no'.")
    if device.type == "cpu" and not cpu_has_native_bf16():
        warnings.warn("mixed_precision='bf16': this CPU has no native bf16 instructions (AVX-512 or AMX), so bf16 "
                      "products run on slow reference kernels; mixed_precision='no' (fp32) is faster here.",
                      stacklevel=2)
    return torch.bfloat16


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN, which runs PyTorch's bf16 products on the CPU, has bf16 kernels here."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """torch.autocast for `dtype` on `device`; a no-op context when `dtype` is None."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


@contextmanager
def training_attention(model, device: torch.device, dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Attention kernel for the loss forward and backward.

    On the CPU in bf16, the fused SDPA kernel's backward runs several times slower than the plain
    matmul-softmax-matmul attention at RL fine-tuning lengths (measured: loss forward+backward of
    16 x 88 tokens on the medium tiny model 142 ms with SDPA, 90 ms with eager attention), so the
    model uses eager attention for the duration. Elsewhere the model's own choice is kept.
    """
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    switch = (dtype is not None and torch.device(device).type == "cpu" and current == "sdpa"
              and hasattr(model, "set_attn_implementation"))
    if not switch:
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(current)
