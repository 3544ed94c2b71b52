"""The oneDNN products compute F.linear's function and its gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comlrl.models import onednn

needs_onednn = pytest.mark.skipif(not onednn.AVAILABLE, reason="this torch build has no oneDNN")


@pytest.fixture
def any_size(monkeypatch):
    """Send fp32 weights of every size through oneDNN (the small ones here would stay on F.linear), on
    any CPU."""
    monkeypatch.setattr(onednn, "MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(onednn, "FP32_THROUGH_ONEDNN", True)  # also where MKL is the faster (no AVX-512)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach(), expected.detach()
    return float((got - expected).abs().max() / expected.abs().max())


def _autograd_products(x, weight, bias, grad):
    """(output, grad of x, grad of weight) of F.linear, by autograd."""
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    out = F.linear(x, weight, bias)
    out.backward(grad)
    return out.detach(), x.grad, weight.grad


def _products(x, weight, bias, grad):
    return onednn.forward(x, weight, bias), onednn.grad_input(grad, weight), onednn.grad_weight(grad, x, weight)


@needs_onednn
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_the_three_products_match_f_linear_and_its_autograd_through_onednn(with_bias, any_size, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(37, 48, generator=generator), torch.randn(24, 48, generator=generator)
    bias = torch.randn(24, generator=generator) if with_bias else None
    grad = torch.randn(37, 24, generator=generator)
    calls = []
    real = onednn._onednn_linear
    monkeypatch.setattr(onednn, "_onednn_linear", lambda *args: calls.append(1) or real(*args))
    for got, expected in zip(_products(x, weight, bias, grad), _autograd_products(x, weight, bias, grad)):
        assert got.shape == expected.shape
        assert _relative_error(got, expected) < 1e-5
    assert len(calls) == 3  # really the oneDNN path


def test_non_fp32_tensors_and_small_weights_keep_torchs_kernels_bitwise(monkeypatch):
    generator = torch.Generator().manual_seed(2)
    for dtype, rows, columns in ((torch.bfloat16, 256, 256), (torch.float32, 3, 8)):
        x, weight = torch.randn(4, columns, generator=generator).to(dtype), torch.randn(rows, columns, generator=generator).to(dtype)
        grad = torch.randn(4, rows, generator=generator).to(dtype)
        for got, expected in zip(_products(x, weight, None, grad), _autograd_products(x, weight, None, grad)):
            assert torch.equal(got, expected)
    weight = torch.randn(3, 8)
    assert not onednn.PackedLinear(weight).packed
    assert not onednn.PackedLinear(weight.bfloat16()).packed
    large = torch.randn(256, 256)
    assert onednn.PackedLinear(large).packed == onednn.FP32_THROUGH_ONEDNN  # AVX-512 CPUs only
    assert onednn.PackedLinear(large.bfloat16()).packed == onednn.BF16_AVAILABLE  # a CPU without native bf16 refuses
    # Without AVX-512, large fp32 weights stay on MKL too (it is the faster there)
    monkeypatch.setattr(onednn, "FP32_THROUGH_ONEDNN", False)
    x, grad = torch.randn(4, 256, generator=generator), torch.randn(4, 256, generator=generator)
    for got, expected in zip(_products(x, large, None, grad), _autograd_products(x, large, None, grad)):
        assert torch.equal(got, expected)
    assert not onednn.PackedLinear(large).packed


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not onednn.BF16_AVAILABLE, reason="oneDNN has no bf16 kernels on this CPU (it needs AVX-512 or AMX)"))],
    ids=["fp32", "bf16"])
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
