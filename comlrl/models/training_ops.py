"""Pieces of the lean training forward (`lean.shared_prompt_logits`) with hand-written backward passes.

Autograd's generic backward of these small compositions makes many passes over the activations
(RMSNorm alone is ~14 ops: pow, mean, rsqrt, four products, their reductions) and keeps several
intermediates alive until the backward pass. Written out, each keeps only what its gradient needs
(RMSNorm: its input and one scalar per row; SwiGLU: its input; rotary: nothing) and runs a handful
of ops. The forwards are the same ops as before, so the logits are bitwise unchanged; gradients
agree with autograd's to float rounding (checked against the transformers model in the tests).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


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
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normalized).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_normalized = grad * weight
        # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat))
        correction = (grad_normalized * normalized).mean(-1, keepdim=True)
        grad_x = (grad_normalized - normalized * correction).mul_(rstd)
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


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


class _Rotary(torch.autograd.Function):
    """Rotary embedding `x * cos + swap_halves(x) * signed_sin`, cast to `out_dtype`: the
    transformers `x * cos + rotate_half(x) * sin`, with rotate_half's negation folded into the sin
    (bitwise the same: negating a factor is exact). The rotation is linear in x, so its backward
    needs only cos and sin: grad_x = grad * cos + swap_halves(grad * signed_sin) (swapping halves
    is its own transpose)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, out_dtype: torch.dtype):
        ctx.save_for_backward(cos, signed_sin)
        ctx.x_dtype = x.dtype
        return (x * cos + _swap_halves(x) * signed_sin).to(out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, signed_sin = ctx.saved_tensors
        grad = grad.to(cos.dtype)
        grad_x = grad * cos + _swap_halves(grad * signed_sin)
        return grad_x.to(ctx.x_dtype), None, None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Rotary embedding of `x` (..., head_dim) by (cos, signed sin), which must not need gradients."""
    return _Rotary.apply(x, cos, signed_sin, out_dtype or torch.promote_types(x.dtype, cos.dtype))
