"""Sampling: same filtering as transformers' warpers, and samples that do not depend on the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from comlrl.models import decode_kernels, load_causal_lm, load_tokenizer
from comlrl.rollout import SamplingSettings, draw_tokens, sample_completions


@pytest.mark.parametrize("uniform_dtype", [torch.float64, torch.float32], ids=["torch-ops", "fp32"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.6, 50, 0.6), (1.0, None, 0.9), (0.7, 5, 1.0), (1.3, 20, 0.3)])
def test_token_distribution_matches_transformers_warpers(temperature, top_k, top_p, uniform_dtype):
    """Drawing with a fine grid of uniforms reproduces the warped distribution of `generate`, with
    the torch ops and (fp32 uniforms and top-k, on a CPU that runs them) the C sampler."""
    torch.manual_seed(0)
    logits = torch.randn(3, 300) * 3
    reference = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        reference = TopKLogitsWarper(top_k)(None, reference)
    if top_p < 1.0:
        reference = TopPLogitsWarper(top_p)(None, reference)
    want = reference.softmax(-1)
    grid = 20000
    uniforms = ((torch.arange(grid, dtype=torch.float64) + 0.5) / grid).to(uniform_dtype)
    settings = SamplingSettings(2, 1, temperature, top_p, top_k)
    for row in range(3):
        tokens = draw_tokens(logits[row:row + 1].expand(grid, -1), uniforms, settings)
        got = torch.bincount(tokens, minlength=300).double() / grid
        assert (got - want[row].double()).abs().max() < 2.0 / grid
        assert set(tokens.tolist()) <= set(torch.nonzero(want[row] > 0).flatten().tolist())


@pytest.mark.skipif(decode_kernels.library() is None, reason="the C kernels need an x86-64 CPU with AVX2 and FMA")
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.6, 50, 0.6), (1.0, 5, 1.0), (1.3, 256, 0.97)])
def test_the_c_sampler_draws_what_the_torch_ops_draw(temperature, top_k, top_p, monkeypatch):
    """Same tokens from the C sampler and the torch ops for 4,000 rows of random logits and uniforms
    (their float sums round differently, so a uniform within rounding of a boundary could differ:
    allowed for at most 2 rows), including rows with -inf (masked) logits; the C sampler runs."""
    generator = torch.Generator().manual_seed(top_k)
    logits = torch.randn(4000, 257, generator=generator) * 3
    logits[::7, :200] = float("-inf")
    uniforms = torch.rand(4000, generator=generator)
    settings = SamplingSettings(1, 1, temperature, top_p, top_k)
    calls, original = [], decode_kernels.draw_tokens
    monkeypatch.setattr(decode_kernels, "draw_tokens", lambda *a: calls.append(1) or original(*a))
    with_kernel = draw_tokens(logits, uniforms, settings)
    assert calls
    monkeypatch.setattr(decode_kernels, "runs", lambda tensor: False)
    with_torch = draw_tokens(logits, uniforms, settings)
    assert (with_kernel != with_torch).sum() <= 2


@pytest.mark.skipif(decode_kernels.library() is None, reason="the C kernels need an x86-64 CPU with AVX2 and FMA")
@pytest.mark.parametrize("vocab, top_k", [(700, 400), (5000, 50)])
def test_the_c_sampler_chooses_other_ways_for_a_big_top_k_or_vocabulary_with_the_same_draws(vocab, top_k,
                                                                                                monkeypatch):
    """The top k of up to 4,096 logits are found by bisecting for the k-th best, of more with a
    heap; up to 256 candidates are sorted by counting ranks, more by a heap sort. Every way draws
    the torch ops' tokens (rounding aside, as above)."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(1500, vocab, generator=generator)
    uniforms = torch.rand(1500, generator=generator)
    settings = SamplingSettings(1, 1, 1.1, 0.95, top_k)
    with_kernel = draw_tokens(logits, uniforms, settings)
    monkeypatch.setattr(decode_kernels, "runs", lambda tensor: False)
    assert (with_kernel != draw_tokens(logits, uniforms, settings)).sum() <= 2


@pytest.mark.skipif(decode_kernels.library() is None, reason="the C kernels need an x86-64 CPU with AVX2 and FMA")
def test_the_c_sampler_breaks_ties_among_the_top_k_by_the_lower_token_id():
    """Integer logits (most of the top k tied): the C sampler draws what a plain Python
    reading of its rule draws (the k best by logit, ties to the lower token id, then top-p and the
    inverse CDF over them, in float32 like the kernel): at most 2 rows of 600 may differ, where a
    uniform falls within float rounding of a boundary."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randint(-4, 4, (600, 97), generator=generator).float()
    uniforms = torch.rand(600, generator=generator)
    top_k, temperature, top_p = 20, 0.8, 0.9
    drawn = decode_kernels.draw_tokens(logits, uniforms, top_k, temperature, top_p)
    f32 = np.float32
    expected = []
    for row, uniform in zip(logits.tolist(), uniforms.tolist()):
        best = sorted(range(len(row)), key=lambda t: (-row[t], t))[:top_k]
        ascending = best[::-1]
        weights = [f32(np.exp(f32(row[t]) / f32(temperature) - f32(row[best[0]]) / f32(temperature)))
                   for t in ascending]
        total = f32(0)
        for w in weights:
            total = f32(total + w)
        first, running = 0, f32(0)
        while first < top_k - 1:
            running = f32(running + weights[first])
            if not running / total <= f32(1 - f32(top_p)):
                break
            first += 1
        cdf, kept = [], f32(0)
        for w in weights[first:]:
            kept = f32(kept + w)
            cdf.append(kept)
        target = f32(f32(uniform) * kept)
        pick = 0
        while pick < len(cdf) - 1 and not cdf[pick] > target:
            pick += 1
        expected.append(ascending[first + pick])
    assert (drawn != torch.tensor(expected)).sum() <= 2


def test_samples_do_not_depend_on_the_batch(tiny_model_dir):
    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    settings = SamplingSettings(num_generations=3, max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50)
    prompts = ["Hi:", "A much longer prompt that pads the short one on the left:"]
    together = sample_completions(model, tok, prompts, settings, keys=[("a",), ("b",)])
    alone = sample_completions(model, tok, prompts[:1], settings, keys=[("a",)])
    assert together.texts[:3] == alone.texts
    again = sample_completions(model, tok, prompts, settings, keys=[("a",), ("b",)])
    assert torch.equal(again.completion_ids, together.completion_ids)
    other = sample_completions(model, tok, prompts, settings, keys=[("c",), ("d",)])
    assert other.texts != together.texts
    assert len(set(together.texts[:3])) == 3  # K samples of one prompt differ


def test_rows_stop_at_eos_and_are_padded_after(tiny_model_dir):
    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    eos = tok.eos_token_id
    # A hot temperature over the random model's 257 tokens: ~1 in 4 rows meets EOS within 64 steps.
    settings = SamplingSettings(num_generations=16, max_new_tokens=64, temperature=3.0, top_p=1.0, top_k=None)
    s = sample_completions(model, tok, ["x"], settings, keys=[("eos",)])
    lengths = s.completion_mask.sum(dim=1)
    assert bool((lengths < s.completion_ids.shape[1]).any()) and int(lengths.max()) == 64
    for row, mask in zip(s.completion_ids, s.completion_mask):
        n = int(mask.sum())
        if n < row.shape[0]:
            assert row[n - 1] == eos and bool((row[n:] == tok.pad_token_id).all())


def test_every_prompt_needs_its_own_key(tiny_model_dir):
    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    with pytest.raises(ValueError, match="got 1 keys for 2 prompts"):
        sample_completions(model, tok, ["a", "b"], SamplingSettings(2, 4, 1.0, 1.0, None), keys=[("a",)])
