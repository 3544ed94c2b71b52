"""The small-row fp32 kernel of the CPU decode steps computes torch.bmm's products, row by row."""

from __future__ import annotations

import logging

import pytest
import torch

from comlrl import rollout
from comlrl.models import onednn, small_gemm
from comlrl.rollout import SamplingSettings
from comlrl.models import load_causal_lm, load_tokenizer

needs_kernel = pytest.mark.skipif(small_gemm.library() is None,
                                  reason="the kernel needs an x86-64 CPU with AVX2 and FMA and a C compiler")


def _weights(agents: int, out_features: int, in_features: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(out_features, in_features, generator=generator) for _ in range(agents)]
    biases = [torch.randn(out_features, generator=generator) for _ in range(agents)]
    return weights, biases


@needs_kernel
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64])
@pytest.mark.parametrize("shape", [(48, 64), (257, 256), (256, 512), (10, 7)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_panel_products_match_bmm(rows, shape, with_bias):
    """Every row count (whole and partial 4-row blocks) and output width (whole and partial 24-wide
    panels), with and without bias, for two agents at once."""
    out_features, in_features = shape
    weights, biases = _weights(2, out_features, in_features, seed=rows)
    x = torch.randn(2, rows, in_features, generator=torch.Generator().manual_seed(1))
    panels = small_gemm.PanelWeights(weights, biases if with_bias else None)
    expected = torch.bmm(x, torch.stack([w.t() for w in weights]))
    if with_bias:
        expected = expected + torch.stack(biases).unsqueeze(1)
    got = panels(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    # Sums of up to 512 products of unit normals: fp32 rounding alone differs by ~1e-5 between orders.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_computes_the_same_in_any_batch():
    """Bitwise: a row's sums do not depend on the rows around it, so a sample does not depend on
    the batch it is decoded in."""
    weights, biases = _weights(1, 100, 96, seed=0)
    panels = small_gemm.PanelWeights(weights, biases)
    x = torch.randn(1, 13, 96, generator=torch.Generator().manual_seed(2))
    together = panels(x)
    for row in range(13):
        assert torch.equal(panels(x[:, row:row + 1]), together[:, row:row + 1])


@needs_kernel
def test_non_contiguous_inputs_and_wrong_shapes():
    weights, _ = _weights(1, 30, 16, seed=0)
    panels = small_gemm.PanelWeights(weights)
    x = torch.randn(1, 16, 5).transpose(1, 2)  # (1, 5, 16), not contiguous
    torch.testing.assert_close(panels(x), x @ weights[0].t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="16 inputs"):
        panels(torch.randn(1, 5, 17))


@needs_kernel
def test_the_library_is_built_once_per_machine_and_a_missing_compiler_falls_back(tmp_path, monkeypatch, caplog):
    first = small_gemm.build(tmp_path)
    assert first is not None and first.exists()
    assert small_gemm.build(tmp_path) == first  # cached: no second compile
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="comlrl.models.small_gemm"):
        assert small_gemm.build(tmp_path / "elsewhere") is None
    assert "decode projections use torch.bmm" in caplog.text


@needs_kernel
def test_kernel_and_bmm_decode_the_same_tokens(tiny_medium_model_dir, monkeypatch):
    """Sampling with the kernel and with torch.bmm (their fp32 sums round differently) gives the same
    completions; and the kernel is what decodes by default here."""
    monkeypatch.setattr(onednn, "FP32_THROUGH_ONEDNN", False)  # CPUs with AVX-512 pack for oneDNN instead
    tok = load_tokenizer(tiny_medium_model_dir)
    models = [load_causal_lm(tiny_medium_model_dir) for _ in range(2)]
    with torch.no_grad():
        for p in models[1].parameters():
            p.mul_(1.01)
    settings = SamplingSettings(num_generations=3, max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50)
    prompts, keys = [["Hi:", "Design a playground on Mars:"], ["Ok:", "A"]], [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    built = []
    original = small_gemm.PanelWeights
    monkeypatch.setattr(small_gemm, "PanelWeights", lambda *a, **k: built.append(1) or original(*a, **k))
    with_kernel = rollout.sample_agents(models, [tok] * 2, prompts, settings, keys, [None] * 2)
    assert built, "the decode steps did not use the kernel"
    monkeypatch.setattr(small_gemm, "usable", lambda weight: False)
    with_bmm = rollout.sample_agents(models, [tok] * 2, prompts, settings, keys, [None] * 2)
    for a, b in zip(with_kernel, with_bmm):
        assert torch.equal(a.completion_ids, b.completion_ids)
