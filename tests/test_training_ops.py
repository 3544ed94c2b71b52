"""The hand-written backward passes of the lean training forward's pieces are the true gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, rotate_half

from comlrl.models import training_ops


def _model_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = Qwen2RMSNorm(x.shape[-1], eps=eps)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm(x)


def _double(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_rms_norm_forward_is_the_models_and_backward_passes_gradcheck():
    x, weight = _double(5, 3, 8, seed=0).requires_grad_(), _double(8, seed=1).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, w: training_ops.rms_norm(a, w, 1e-6), (x, weight))
    x, weight = x.detach().float(), weight.detach().float()  # the model's dtype: the same ops as its norm
    assert torch.equal(training_ops.rms_norm(x, weight, 1e-6), _model_norm(x, weight, 1e-6))
    cast = training_ops.rms_norm(x, weight, 1e-6, torch.bfloat16)
    assert cast.dtype == torch.bfloat16
    assert torch.equal(cast, _model_norm(x, weight, 1e-6).to(torch.bfloat16))


def test_swiglu_forward_is_silu_gate_times_up_and_backward_passes_gradcheck():
    gate_up = _double(4, 2, 12, seed=2).requires_grad_()
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(training_ops.swiglu(gate_up), F.silu(gate) * up)
    assert torch.autograd.gradcheck(training_ops.swiglu, (gate_up,))


def test_rotary_is_the_models_on_pair_adjacent_rows_and_backward_passes_gradcheck():
    """On a head whose rotary pairs (i, i + D/2) are adjacent, the rotation is the transformers
    rotary embedding, reordered alike."""
    x, angles = _double(6, 3, 8, seed=3), _double(6, 1, 4, seed=4)
    cos, sin = torch.cat([angles.cos(), angles.cos()], dim=-1), torch.cat([angles.sin(), angles.sin()], dim=-1)
    adjacent = torch.arange(8).view(2, 4).t().reshape(-1)  # 0, 4, 1, 5, ...
    rotation = torch.complex(angles.cos(), angles.sin())
    expected = (x * cos + rotate_half(x) * sin)[..., adjacent]
    assert torch.allclose(training_ops.rotary(x[..., adjacent], rotation), expected, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a: training_ops.rotary(a, rotation), (x[..., adjacent].requires_grad_(),))
    rounded = training_ops.rotary(x[..., adjacent].float(), rotation.to(torch.complex64), torch.bfloat16)
    assert rounded.dtype == torch.bfloat16
    assert torch.allclose(rounded.double(), expected, atol=2e-2)
