"""The oneDNN linear layers compute F.linear's function, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comlrl.models import onednn

needs_onednn = pytest.mark.skipif(not onednn.AVAILABLE, reason="this torch build has no oneDNN")


@pytest.fixture
def any_size(monkeypatch):
    """Send fp32 weights of every size through oneDNN (the small ones here would stay on F.linear)."""
    monkeypatch.setattr(onednn, "MIN_WEIGHT_ELEMENTS", 0)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach(), expected.detach()
    return float((got - expected).abs().max() / expected.abs().max())


@needs_onednn
@pytest.mark.parametrize("shape", [(37, 48), (3, 5, 48)], ids=["2d", "3d"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_linear_matches_f_linear_forward_and_backward(shape, with_bias, any_size):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator).requires_grad_()
    weight = torch.randn(24, 48, generator=generator).requires_grad_()
    bias = torch.randn(24, generator=generator).requires_grad_() if with_bias else None
    grad = torch.randn(*shape[:-1], 24, generator=generator)

    got = onednn.linear(x, weight, bias)
    got.backward(grad)
    got_grads = [t.grad.clone() for t in (x, weight, bias) if t is not None]
    for t in (x, weight, bias):
        if t is not None:
            t.grad = None
    expected = F.linear(x, weight, bias)
    expected.backward(grad)
    expected_grads = [t.grad for t in (x, weight, bias) if t is not None]

    assert got.shape == expected.shape
    assert _relative_error(got, expected) < 1e-5
    for g, e in zip(got_grads, expected_grads):
        assert _relative_error(g, e) < 1e-5
    node = got.grad_fn if len(shape) == 2 else got.grad_fn.next_functions[0][0]  # 3d: a view of the 2d product
    assert "_Linear" in type(node).__name__  # really the oneDNN path


def test_linear_leaves_non_fp32_tensors_and_small_weights_to_f_linear_and_unpacked():
    x, weight = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(onednn.linear(x, weight), F.linear(x, weight))
    x, weight = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8)
    small = onednn.linear(x, weight)
    assert torch.equal(small, F.linear(x, weight)) and "_Linear" not in type(small.grad_fn).__name__
    assert not onednn.PackedLinear(weight).packed
    assert not onednn.PackedLinear(weight.bfloat16()).packed
    large = torch.randn(256, 256)
    assert onednn.PackedLinear(large).packed == onednn.PackedLinear(large.bfloat16()).packed == onednn.AVAILABLE


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_linear_matches_f_linear_and_rows_do_not_depend_on_the_batch(dtype, any_size):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(32, 64, generator=generator).to(dtype)
    packed = onednn.PackedLinear(weight, bias)
    assert packed.packed and packed.weight.is_mkldnn
    full = packed(x)
    assert _relative_error(full.float(), F.linear(x, weight, bias).float()) < (1e-5 if dtype == torch.float32 else 1e-2)
    for rows in (1, 3, 8, 16):  # a row's result is the same in any batch (decode samples must not depend on it)
        assert torch.equal(packed(x[:rows]), full[:rows])
