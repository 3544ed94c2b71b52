"""Pieces of the lean training forward (`lean.shared_prompt_logits`) with hand-written backward passes.

Autograd's generic backward of these small compositions makes many passes over the activations
(RMSNorm alone is ~14 ops: pow, mean, rsqrt, four products, their reductions) and keeps several
intermediates alive until the backward pass. Written out, each keeps only what its gradient needs
(RMSNorm: its input and one scalar per row; SwiGLU: its input; rotary: only its rotation table)
and runs a handful of ops. RMSNorm and SwiGLU forwards are the transformers model's ops, bitwise;
the rotary embedding is one complex multiply on pair-adjacent rows, equal to the model's to float
rounding. Gradients agree with autograd's to float rounding (checked against the transformers
model in the tests).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    wide = torch.promote_types(x.dtype, torch.float32)
    return x if x.dtype == wide else x.to(wide)  # no dispatch for a no-op cast (decode hot path)


class _RMSNorm(torch.autograd.Function):
    """`(weight * x * rsqrt(mean(x^2) + eps)).to(out_dtype)`, computed in fp32 as the transformers
    norm computes it, then cast for the projection that reads it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype):
        x32 = _at_least_fp32(x)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (weight * (x32 * rstd).to(x.dtype)).to(out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normalized = _at_least_fp32(x) * rstd
        grad = grad.to(normalized.dtype)
        width = x.shape[-1]
        grad_weight = None
        if ctx.needs_input_grad[1]:  # sum over rows of grad * x_hat, as one multiply-reduce
            grad_weight = torch.linalg.vecdot(grad.reshape(-1, width), normalized.reshape(-1, width), dim=0)
            grad_weight = grad_weight.to(weight.dtype)
        grad_normalized = grad * weight
        # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat))
        correction = torch.linalg.vecdot(grad_normalized, normalized).unsqueeze_(-1).div_(width)
        grad_x = torch.addcmul(grad_normalized, normalized, correction, value=-1).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """RMSNorm of `x` scaled by `weight`, cast to `out_dtype` (default: x's dtype)."""
    return _RMSNorm.apply(x, weight, eps, out_dtype or x.dtype)


class _SwiGLU(torch.autograd.Function):
    """`silu(gate) * up` of a fused gate/up projection's output (columns gate, then up). Keeps only
    that output for the backward pass and recomputes silu from it."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor):
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        torch.mul(grad, F.silu(gate), out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_gate_up


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate_up)


def rotate_pairs(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` (..., head_dim) whose rotary pairs (i, i + head_dim / 2) are
    adjacent (rows reordered by `lean._pairs_adjacent`): each pair (a, b) as the complex number
    a + ib, times `rotation` = cos + i sin, is (a cos - b sin, a sin + b cos), what the transformers
    rotary embedding computes for the pair. Returns fp32 (or wider), contiguous."""
    pairs = torch.view_as_complex(_at_least_fp32(x).unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2)


class _Rotary(torch.autograd.Function):
    """`rotate_pairs(x, rotation)` cast to `out_dtype`. The rotation is linear in x and unitary,
    so its backward needs only the rotation: grad_x = grad * conj(rotation), pair by pair."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rotation: torch.Tensor, out_dtype: torch.dtype):
        ctx.save_for_backward(rotation)
        ctx.x_dtype = x.dtype
        return rotate_pairs(x, rotation).to(out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rotation,) = ctx.saved_tensors
        grad_x = rotate_pairs(grad.contiguous(), rotation.conj())
        return grad_x.to(ctx.x_dtype), None, None


def rotary(x: torch.Tensor, rotation: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Rotary embedding of `x` (..., head_dim), rotary pairs adjacent, by `rotation` (complex,
    broadcast over x's pairs; it must not need gradients); see `rotate_pairs`."""
    return _Rotary.apply(x, rotation, out_dtype or torch.promote_types(x.dtype, torch.float32))
