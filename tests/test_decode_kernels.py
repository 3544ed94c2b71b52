"""The CPU decode kernels compute what torch computes: products with few rows (row by row, as
torch.bmm), the decode step's attention, rotary embedding + cache write, residual-add + norm
and SwiGLU."""

from __future__ import annotations

import logging

import pytest
import torch

from comlrl import rollout
from comlrl.models import onednn, decode_kernels, lean
from comlrl.rollout import SamplingSettings
from comlrl.models import load_causal_lm, load_tokenizer

needs_kernel = pytest.mark.skipif(decode_kernels.library() is None,
                                  reason="the kernel needs an x86-64 CPU with AVX2 and FMA and a C compiler")


def _weights(agents: int, out_features: int, in_features: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(out_features, in_features, generator=generator) for _ in range(agents)]
    biases = [torch.randn(out_features, generator=generator) for _ in range(agents)]
    return weights, biases


#: The kernel families this CPU runs: 6-, 8- and 16-wide panels in AVX2, and 16-wide in AVX-512 on
#: CPUs that have it.
FAMILIES = [dict(width=6), dict(width=8), dict(width=16, avx512=False)] + (
    [dict(width=16, avx512=True)] if decode_kernels.AVX512_PANELS else [])
WIDTHS = pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f"panels{f['width']}" + (
    "" if f["width"] < 16 else "-avx512" if f["avx512"] else "-avx2"))


@needs_kernel
@WIDTHS
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 29, 64])
@pytest.mark.parametrize("shape", [(48, 64), (257, 256), (256, 512), (10, 7)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_panel_products_match_bmm(rows, shape, with_bias, family):
    """Every row count (whole and partial blocks of 16, 8, 6 and 4 rows) and output width (whole and
    partial panels), with and without bias, for two agents at once."""
    out_features, in_features = shape
    weights, biases = _weights(2, out_features, in_features, seed=rows)
    x = torch.randn(2, rows, in_features, generator=torch.Generator().manual_seed(1))
    panels = decode_kernels.PanelWeights(weights, biases if with_bias else None, **family)
    expected = torch.bmm(x, torch.stack([w.t() for w in weights]))
    if with_bias:
        expected = expected + torch.stack(biases).unsqueeze(1)
    got = panels(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    # Sums of up to 512 products of unit normals: fp32 rounding alone differs by ~1e-5 between orders.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@needs_kernel
@WIDTHS
def test_a_row_computes_the_same_in_any_batch(family):
    """Bitwise: a row's sums do not depend on the rows around it, so a sample does not depend on
    the batch it is decoded in."""
    weights, biases = _weights(1, 100, 96, seed=0)
    panels = decode_kernels.PanelWeights(weights, biases, **family)
    x = torch.randn(1, 29, 96, generator=torch.Generator().manual_seed(2))
    together = panels(x)
    for row in range(29):
        assert torch.equal(panels(x[:, row:row + 1]), together[:, row:row + 1])


@needs_kernel
@pytest.mark.parametrize("rows", [8, 16, 29])
def test_every_kernel_family_agrees_bitwise(rows):
    """All families sum each output over the inputs in order, one fused multiply-add at a time,
    whatever their register blocking (8 x 8, 6 x 16 and 4 x 16 rows x outputs and 16 x 6 and 8 x 12
    in AVX2, 16 x 16 in AVX-512)."""
    weights, biases = _weights(2, 300, 200, seed=3)
    x = torch.randn(2, rows, 200, generator=torch.Generator().manual_seed(4))
    first, *others = (decode_kernels.PanelWeights(weights, biases, **family)(x) for family in FAMILIES)
    assert others and all(torch.equal(first, other) for other in others)


@needs_kernel
@WIDTHS
@pytest.mark.parametrize("in_features", [64, 70], ids=["in64", "in70"])
def test_weights_packed_from_their_parts_with_a_norm_folded_in_equal_the_joined_weight(family, in_features):
    """A QKV-like projection packed straight from its parameters (query and key rows reordered
    through a strided view, then the value rows, the norm folded into the columns) packs and
    multiplies bitwise as the weight `training_ops.joined_weight` makes; the same for a plain
    part with a norm (gate/up, the LM head) and without (nothing to fold). Inputs past a multiple
    of 8 (70) go through the element-by-element tail."""
    from comlrl.models import training_ops

    generator = torch.Generator().manual_seed(11)
    heads, kv_heads, dim = 3, 1, 8
    agents_parts, norms = [], []
    for _ in range(2):
        q = torch.randn(heads * dim, in_features, generator=generator)
        k = torch.randn(kv_heads * dim, in_features, generator=generator)
        v = torch.randn(kv_heads * dim, in_features, generator=generator)
        agents_parts.append([lean._pairs_adjacent(q, heads, dim), lean._pairs_adjacent(k, kv_heads, dim), v])
        norms.append(torch.rand(in_features, generator=generator) + 0.5)
    x = torch.randn(2, 13, in_features, generator=generator)
    cases = [(agents_parts, norms), ([parts[2:] for parts in agents_parts], norms),
             ([parts[2:] for parts in agents_parts], None)]
    for parts, norm in cases:
        joined = [training_ops.joined_weight(p, torch.float32, None if norm is None else norm[a])
                  for a, p in enumerate(parts)]
        assert not torch.equal(joined[0], torch.cat([t.reshape(-1, in_features) for t in parts[0]])) or norm is None
        from_parts = decode_kernels.PanelWeights(parts, norms=norm, **family)
        from_joined = decode_kernels.PanelWeights(joined, **family)
        assert torch.equal(from_parts.packed, from_joined.packed)
        assert torch.equal(from_parts(x), from_joined(x))
        torch.testing.assert_close(from_parts(x), torch.stack([x[a] @ w.t() for a, w in enumerate(joined)]),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="is not"):
        decode_kernels.PanelWeights([agents_parts[0], agents_parts[1][:2]], **family)


def test_a_panel_width_or_family_the_kernels_lack_is_refused():
    if decode_kernels.library() is None:
        pytest.skip("no kernel library here")
    with pytest.raises(ValueError, match="panel width 12"):
        decode_kernels.PanelWeights(_weights(1, 8, 8, seed=0)[0], width=12)
    if not decode_kernels.AVX512_PANELS:
        with pytest.raises(ValueError, match="AVX-512"):
            decode_kernels.PanelWeights(_weights(1, 8, 8, seed=0)[0], width=16, avx512=True)


@needs_kernel
def test_non_contiguous_inputs_and_wrong_shapes():
    weights, _ = _weights(1, 30, 16, seed=0)
    panels = decode_kernels.PanelWeights(weights)
    x = torch.randn(1, 16, 5).transpose(1, 2)  # (1, 5, 16), not contiguous
    torch.testing.assert_close(panels(x), x @ weights[0].t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="16 inputs"):
        panels(torch.randn(1, 5, 17))


@needs_kernel
def test_products_into_a_given_output():
    """`out=` writes into the caller's buffer (the decode step reuses one per projection), bitwise
    what a fresh output gets; a buffer of the wrong shape or dtype is refused, not overrun."""
    weights, biases = _weights(2, 40, 24, seed=5)
    panels = decode_kernels.PanelWeights(weights, biases)
    x = torch.randn(2, 6, 24, generator=torch.Generator().manual_seed(6))
    out = torch.full((2, 6, 40), float("nan"))
    assert panels(x, out) is out
    assert torch.equal(out, panels(x))
    for wrong in (torch.empty(2, 6, 41), torch.empty(2, 6, 40, dtype=torch.float64), torch.empty(2, 40, 6).transpose(1, 2)):
        with pytest.raises(ValueError, match="output must be"):
            panels(x, wrong)


@needs_kernel
def test_the_library_is_built_once_per_machine_and_a_missing_compiler_falls_back(tmp_path, monkeypatch, caplog):
    first = decode_kernels.build(tmp_path)
    assert first is not None and first.exists()
    assert decode_kernels.build(tmp_path) == first  # cached: no second compile
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="comlrl.models.decode_kernels"):
        assert decode_kernels.build(tmp_path / "elsewhere") is None
    assert "decode projections use torch.bmm" in caplog.text


def _attention_inputs(seed: int, heads: int, kv_heads: int, dim: int, width: int, max_new: int, group_size: int,
                      prompts: int):
    """Random (query_key, prefix_keys, prefix_values, keys, values, bias) in `decode_kernels.attention`'s
    layout; rows of one prompt share its prefix but not their bias."""
    generator = torch.Generator().manual_seed(seed)
    rows = prompts * group_size
    return (torch.randn(rows, heads + kv_heads, dim, generator=generator),
            torch.randn(prompts, kv_heads, dim, width, generator=generator),
            torch.randn(prompts, kv_heads, width, dim, generator=generator),
            torch.randn(rows, kv_heads, dim, max_new, generator=generator),
            torch.randn(rows, kv_heads, max_new, dim, generator=generator),
            0.5 * torch.randn(rows, 1, 1, width + max_new, generator=generator))


def _reference_attention(query_key, heads, group_size, prefix_keys, prefix_values, keys, values, steps, bias, scale):
    """Row by row and head by head, in float64: softmax over the prompt's and the row's own columns."""
    rows, _, dim = query_key.shape
    kv_heads = query_key.shape[1] - heads
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    width = prefix_keys.shape[-1]
    for r in range(rows):
        prompt = r // group_size
        for h in range(heads):
            kv = h // (heads // kv_heads)
            all_keys = torch.cat([prefix_keys[prompt, kv], keys[r, kv, :, :steps]], dim=1).double()  # (D, width + steps)
            all_values = torch.cat([prefix_values[prompt, kv], values[r, kv, :steps]]).double()
            scores = bias[r, 0, 0, : width + steps].double() + scale * (query_key[r, h].double() @ all_keys)
            out[r, h] = scores.softmax(-1) @ all_values
    return out.reshape(rows, heads * dim)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, dim, width, max_new, steps", [
    (4, 2, 16, 11, 24, 1), (4, 2, 16, 11, 24, 5), (4, 2, 16, 11, 24, 19),
    (6, 2, 64, 40, 48, 37),  # 3 query heads per KV head: a pair, then one alone; 32 + 8 and 32 + 5 columns
    (2, 2, 72, 33, 64, 64),  # one query head per KV head; 64 + 8 outputs per head; 32 + 1 prompt columns
], ids=["gqa-1", "gqa-5", "gqa-19", "group3-dim64", "mha-dim72"])
def test_decode_attention_matches_a_plain_softmax_attention(heads, kv_heads, dim, width, max_new, steps):
    """Grouped-query heads, 3 rows per prompt, left padding masked with -inf (those columns get
    exactly zero weight), generated columns past `steps` ignored; column counts and head sizes that
    take every blocking of the kernel (4, 2 and 1 blocks of 8 columns, masked tails, heads in pairs
    and alone, 32 and 8 outputs at a time)."""
    group_size, prompts = 3, 2
    rows = prompts * group_size
    query_key, prefix_keys, prefix_values, keys, values, bias = _attention_inputs(
        steps, heads, kv_heads, dim, width, max_new, group_size, prompts)
    bias[:group_size, ..., :4] = float("-inf")  # the first prompt is left-padded by 4
    values_poisoned = values.clone()
    values_poisoned[:, :, steps:] = float("nan")  # columns not generated yet must not be read
    scale = dim ** -0.5
    got = decode_kernels.attention(query_key, heads, group_size, prefix_keys, prefix_values, keys, values_poisoned,
                                   steps, bias, scale)
    expected = _reference_attention(query_key, heads, group_size, prefix_keys, prefix_values, keys, values, steps,
                                    bias, scale)
    assert got.shape == (rows, heads * dim)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-6)
    padded_values = prefix_values.clone()
    padded_values[0, :, :4] = 1e6  # masked columns: weight exactly 0, so no trace of these
    again = decode_kernels.attention(query_key, heads, group_size, prefix_keys, padded_values, keys, values, steps,
                                     bias, scale)
    assert torch.equal(again[:group_size], got[:group_size])


@needs_kernel
@pytest.mark.parametrize("padding", [7, 8, 13, 33])
def test_decode_attention_skips_whole_lane_groups_of_padding_bit_for_bit(padding):
    """A prompt's left padding (-inf bias) is skipped in whole groups of 8 columns, which keeps the
    result bitwise what summing those columns' zero weights gives: the same padding masked with a
    finite -1e30 instead (weights exactly 0 as well, but not skippable) gives the same bits. The
    second prompt has no padding; its rows are unchanged either way. A row of the first prompt
    that masks fewer columns than the others keeps them all (the skip is the least of its rows')."""
    heads, kv_heads, dim, width, max_new, steps, group_size = 4, 2, 16, 41, 12, 7, 3
    inputs = list(_attention_inputs(5, heads, kv_heads, dim, width, max_new, group_size, 2))
    bias = inputs[5]
    skipped, summed = bias.clone(), bias.clone()
    skipped[:group_size, ..., :padding] = float("-inf")
    summed[:group_size, ..., :padding] = -1e30
    skipped[1, ..., padding - 8:padding] = summed[1, ..., padding - 8:padding] = 0.25  # row 1 masks 8 fewer
    scale = dim ** -0.5
    got = decode_kernels.attention(inputs[0], heads, group_size, *inputs[1:5], steps, skipped, scale)
    want = decode_kernels.attention(inputs[0], heads, group_size, *inputs[1:5], steps, summed, scale)
    assert torch.equal(got, want)
    expected = _reference_attention(inputs[0], heads, group_size, *inputs[1:5], steps, skipped, scale)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_decode_attention_takes_a_prompt_with_many_rows_in_parts():
    """A prompt's rows x query heads per KV head past the kernel's 256 go in parts that share the
    prefix: 130 rows x 2 heads here, so parts of 128 rows and 2."""
    heads, steps, group_size, dim = 4, 5, 130, 16
    inputs = _attention_inputs(11, heads, 2, dim, 11, 8, group_size, 2)
    got = decode_kernels.attention(inputs[0], heads, group_size, *inputs[1:5], steps, inputs[5], dim ** -0.5)
    expected = _reference_attention(inputs[0], heads, group_size, *inputs[1:5], steps, inputs[5], dim ** -0.5)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_rotate_into_cache_rotates_in_place_and_writes_one_cache_column():
    """Query and key heads rotated as `rotate_pairs` rotates them; the keys (transposed) and values
    land in column 2 of each row's cache and nowhere else."""
    from comlrl.models.training_ops import rotate_pairs
    generator = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, dim, max_new = 5, 4, 2, 16, 6
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator)
    angles = torch.randn(rows, 1, dim // 2, generator=generator)
    rotation = torch.polar(torch.ones_like(angles), angles)
    keys = torch.randn(rows, kv_heads, dim, max_new, generator=generator)
    values = torch.randn(rows, kv_heads, max_new, dim, generator=generator)
    keys_before, values_before, original = keys.clone(), values.clone(), qkv.clone()
    heads_view = decode_kernels.rotate_into_cache(qkv, rotation, heads, keys, values, 2)
    assert heads_view.data_ptr() == qkv.data_ptr() and heads_view.shape == (rows, heads + 2 * kv_heads, dim)
    expected = rotate_pairs(original.view(rows, -1, dim)[:, : heads + kv_heads], rotation)
    torch.testing.assert_close(heads_view[:, : heads + kv_heads], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(heads_view[:, heads + kv_heads:], original.view(rows, -1, dim)[:, heads + kv_heads:])
    assert torch.equal(keys[..., 2], heads_view[:, heads: heads + kv_heads])
    assert torch.equal(values[:, :, 2], heads_view[:, heads + kv_heads:])
    others = [c for c in range(max_new) if c != 2]
    assert torch.equal(keys[..., others], keys_before[..., others])
    assert torch.equal(values[:, :, others], values_before[:, :, others])
    with pytest.raises(ValueError, match="column"):
        decode_kernels.rotate_into_cache(qkv, rotation, heads, keys, values, max_new)


@needs_kernel
@pytest.mark.parametrize("conjugate", [False, True], ids=["rotate", "conjugate"])
def test_rotate_matches_the_complex_product_on_strided_rows(conjugate):
    from comlrl.models.training_ops import rotate_pairs
    generator = torch.Generator().manual_seed(5)
    qkv = torch.randn(7, 8 * 16, generator=generator)
    x = qkv[:, : 6 * 16].view(7, 6, 16)  # query and key heads of a QKV output: rows strided
    angles = torch.randn(7, 1, 8, generator=generator)
    rotation = torch.polar(torch.ones_like(angles), angles)
    got = decode_kernels.rotate(x, rotation, conjugate)
    expected = rotate_pairs(x, rotation.conj() if conjugate else rotation)
    assert got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert decode_kernels.rotate(x.double(), rotation, conjugate) is None  # not a layout it takes


@needs_kernel
@pytest.mark.parametrize("dim", [256, 64, 13])
@pytest.mark.parametrize("with_delta", [True, False], ids=["residual", "norm-only"])
def test_residual_rms_norm_adds_in_place_and_matches_rms_norm(dim, with_delta):
    generator = torch.Generator().manual_seed(dim)
    hidden = torch.randn(2, 5, dim, generator=generator) * 3
    hidden[0, 1] = 0.0  # an all-zero row stays finite: eps keeps the root mean square above zero
    delta = torch.randn(2, 5, dim, generator=generator) if with_delta else None
    expected_hidden = hidden + delta if with_delta else hidden.clone()
    expected = torch.nn.functional.rms_norm(expected_hidden, (dim,), eps=1e-6)
    got = decode_kernels.residual_rms_norm(hidden, delta, 1e-6)
    assert torch.equal(hidden, expected_hidden)  # the same single add, in place
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
    assert torch.isfinite(got).all()
    with pytest.raises(ValueError, match="contiguous"):
        decode_kernels.residual_rms_norm(hidden.transpose(0, 1), None, 1e-6)


@needs_kernel
@pytest.mark.parametrize("n", [512, 64, 11])
def test_silu_mul_matches_swiglu(n):
    generator = torch.Generator().manual_seed(n)
    gate_up = torch.randn(3, 4, 2 * n, generator=generator) * 4
    gate_up[0, 0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # far tails: silu -> -0 and -> g
    gate, up = gate_up.split(n, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(decode_kernels.silu_mul(gate_up), expected, rtol=3e-6, atol=1e-6)
    with pytest.raises(ValueError, match="gate"):
        decode_kernels.silu_mul(torch.randn(2, 7))


@needs_kernel
@pytest.mark.parametrize("n", [512, 11])
def test_swiglu_backward_gives_the_forward_output_bitwise_and_the_true_gradient(n):
    generator = torch.Generator().manual_seed(n)
    gate_up = torch.randn(5, 2 * n, generator=generator) * 4
    grad_hidden = torch.randn(5, n, generator=generator)
    hidden, grad_gate_up = decode_kernels.swiglu_backward(gate_up, grad_hidden)
    assert torch.equal(hidden, decode_kernels.silu_mul(gate_up))  # what the weight gradient sees
    leaf = gate_up.double().requires_grad_()
    gate, up = leaf.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(grad_hidden.double())
    torch.testing.assert_close(grad_gate_up.double(), leaf.grad, rtol=2e-5, atol=2e-5)


needs_avx512 = pytest.mark.skipif(decode_kernels.library() is None or not decode_kernels.AVX512_PANELS,
                                  reason="the weight-gradient kernel runs on CPUs with AVX-512")


@needs_avx512
@pytest.mark.parametrize("tokens, out_features, in_features", [
    (600, 1024, 256),  # an L chunk's gate/up: three token chunks of the kernel, the last partial
    (256, 257, 256),  # exactly one token chunk; one output past the last 16-wide block
    (37, 5, 33),  # blocks narrower than 16 on both sides
    (1, 16, 16),
])
def test_weight_gradient_is_grad_transposed_times_input(tokens, out_features, in_features):
    generator = torch.Generator().manual_seed(tokens)
    # Rows strided as a QKV or gate/up output's slices are: the kernel reads them in place.
    grad = torch.randn(tokens, out_features + 7, generator=generator)[:, 3:3 + out_features]
    x = torch.randn(tokens, in_features + 2, generator=generator)[:, :in_features]
    got = decode_kernels.grad_weight(grad, x)
    assert got.shape == (out_features, in_features) and got.is_contiguous()
    expected = grad.double().t() @ x.double()
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-6 * tokens ** 0.5 * 4)
    # Each element sums over the tokens in order whatever else is in the call: a block of outputs
    # or inputs alone gives the same values bit for bit.
    assert torch.equal(decode_kernels.grad_weight(grad[:, 1:4], x), got[1:4])
    assert torch.equal(decode_kernels.grad_weight(grad, x[:, 2:19]), got[:, 2:19])


@needs_avx512
def test_weight_gradient_of_no_tokens_is_zero_and_bad_layouts_are_refused():
    assert torch.equal(decode_kernels.grad_weight(torch.empty(0, 20), torch.empty(0, 9)), torch.zeros(20, 9))
    with pytest.raises(ValueError, match="contiguous rows"):
        decode_kernels.grad_weight(torch.randn(8, 20).t(), torch.randn(20, 9))
    with pytest.raises(ValueError, match="fp32"):
        decode_kernels.grad_weight(torch.randn(8, 20, dtype=torch.float64), torch.randn(8, 9, dtype=torch.float64))


def _causal_weights(blocks: int, heads: int, period: int, generator) -> torch.Tensor:
    """(blocks, heads * period, period) weights that are 0 past each row's position, as the
    attention's probabilities and score gradients are after the softmax kernels."""
    weights = torch.randn(blocks, heads * period, period, generator=generator)
    position = torch.arange(heads * period) % period
    return weights.masked_fill(torch.arange(period) > position[:, None], 0.0)


#: The own-token products' kernel families this CPU runs: AVX2, and AVX-512 where it has it.
OWN_FAMILIES = pytest.mark.parametrize("avx512", [False] + ([True] if decode_kernels.AVX512_PANELS else []),
                                       ids=lambda a: "avx512" if a else "avx2")
OWN_SHAPES = pytest.mark.parametrize("blocks, heads, period, dim", [
    (16, 2, 63, 64),  # the L benchmark's blocks
    (3, 3, 17, 8),  # narrow heads: masked lanes
    (2, 1, 1, 16),  # one step
    (4, 2, 40, 24),  # a 16-float chunk of dim half masked
    (2, 2, 70, 128),  # two 64-wide passes; five 16-column blocks
    (1, 5, 13, 20),  # row groups of 4 and of 6 that straddle heads
])


def _own_operands(blocks: int, heads: int, period: int, dim: int):
    generator = torch.Generator().manual_seed(period * dim)
    queries = torch.randn(blocks, heads * period, dim, generator=generator)
    keys = torch.randn(blocks, period, dim, generator=generator)
    return queries, keys, _causal_weights(blocks, heads, period, generator)


@needs_kernel
@OWN_FAMILIES
@OWN_SHAPES
def test_own_token_products_compute_the_causal_half_of_the_batched_products(avx512, blocks, heads, period, dim):
    """The training attention's products over each row's own tokens (`own_scores`, `own_weighted`,
    `own_transposed`) equal torch.bmm where a row sees the key (position >= key), to float rounding."""
    queries, keys, weights = _own_operands(blocks, heads, period, dim)
    seen = torch.arange(period) <= (torch.arange(heads * period) % period)[:, None]
    scores = decode_kernels.own_scores(queries, keys, avx512=avx512)
    expected = torch.bmm(queries.double(), keys.double().transpose(1, 2))
    torch.testing.assert_close(torch.where(seen, scores.double(), 0.0), torch.where(seen, expected, 0.0),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode_kernels.own_weighted(weights, keys, avx512=avx512).double(),
                               torch.bmm(weights.double(), keys.double()), rtol=1e-5, atol=1e-5)
    transposed = decode_kernels.own_transposed(weights, queries, avx512=avx512)
    torch.testing.assert_close(transposed.double(), torch.bmm(weights.double().transpose(1, 2), queries.double()),
                               rtol=1e-5, atol=1e-5)
    # Weights without room past their end are copied first (the kernels read 4 or 6 keys at a time).
    tight = torch.empty(weights.numel()).view_as(weights).copy_(weights)
    assert torch.equal(decode_kernels.own_transposed(tight, queries, avx512=avx512), transposed)


@needs_kernel
@OWN_SHAPES
def test_own_token_products_columns_past_the_period_are_never_written(blocks, heads, period, dim):
    """Score rows are `period` long and back to back: a column block running past the period must
    stop there or it would overwrite the next row's first scores."""
    queries, keys, _ = _own_operands(blocks, heads, period, dim)
    scores = decode_kernels.own_scores(queries, keys, avx512=False)
    seen = torch.arange(period) <= (torch.arange(heads * period) % period)[:, None]
    expected = torch.bmm(queries.double(), keys.double().transpose(1, 2))
    # Position 0's only seen column is column 0: anything stored past a row's end lands there.
    first = torch.where(seen, scores.double(), 0.0)[:, :, 0]
    torch.testing.assert_close(first, expected[:, :, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(decode_kernels.library() is None or not decode_kernels.AVX512_PANELS,
                    reason="compares the AVX2 own-token kernels with the AVX-512 ones")
@OWN_SHAPES
def test_own_token_products_agree_bit_for_bit_across_kernel_families(blocks, heads, period, dim):
    queries, keys, weights = _own_operands(blocks, heads, period, dim)
    seen = torch.arange(period) <= (torch.arange(heads * period) % period)[:, None]
    avx2, avx512 = (decode_kernels.own_scores(queries, keys, avx512=a) for a in (False, True))
    assert torch.equal(torch.where(seen, avx2, 0.0), torch.where(seen, avx512, 0.0))
    for product, operand in ((decode_kernels.own_weighted, keys), (decode_kernels.own_transposed, queries)):
        assert torch.equal(product(weights, operand, avx512=False), product(weights, operand, avx512=True))


@needs_kernel
def test_own_token_products_refuse_shapes_that_are_not_whole_periods():
    with pytest.raises(ValueError, match="whole periods"):
        decode_kernels.own_scores(torch.randn(2, 7, 8), torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="contiguous fp32"):
        decode_kernels.own_weighted(torch.randn(2, 6, 3).transpose(1, 2), torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="head size"):
        decode_kernels.own_scores(torch.randn(2, 6, 8), torch.randn(2, 3, 4))


@needs_kernel
def test_decode_kernels_and_torch_ops_decode_the_same_tokens(tiny_medium_model_dir, monkeypatch):
    """Sampling with the kernels (projections, attention, norms, SwiGLU) and with torch ops (their fp32 sums
    round differently) gives the same completions; and the kernels are what decodes by default here."""
    monkeypatch.setattr(onednn, "FP32_THROUGH_ONEDNN", True)  # the kernels take precedence over oneDNN's packing
    tok = load_tokenizer(tiny_medium_model_dir)
    models = [load_causal_lm(tiny_medium_model_dir) for _ in range(2)]
    with torch.no_grad():
        for p in models[1].parameters():
            p.mul_(1.01)
    settings = SamplingSettings(num_generations=3, max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50)
    prompts, keys = [["Hi:", "Design a playground on Mars:"], ["Ok:", "A"]], [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    built, attended = [], []
    original_panels, original_attention = decode_kernels.PanelWeights, decode_kernels.attention
    monkeypatch.setattr(decode_kernels, "PanelWeights", lambda *a, **k: built.append(1) or original_panels(*a, **k))
    monkeypatch.setattr(decode_kernels, "attention", lambda *a, **k: attended.append(1) or original_attention(*a, **k))
    normalized, original_norm = [], decode_kernels.residual_rms_norm
    monkeypatch.setattr(decode_kernels, "residual_rms_norm", lambda *a: normalized.append(1) or original_norm(*a))
    stepped, original_step = [], decode_kernels.DecodeStepPlan.__call__
    monkeypatch.setattr(decode_kernels.DecodeStepPlan, "__call__", lambda *a: stepped.append(1) or original_step(*a))
    with_kernels = rollout.sample_agents(models, [tok] * 2, prompts, settings, keys, [None] * 2)
    assert built and stepped and normalized, "the decode steps did not use the kernels"
    assert not attended  # the whole step is one C call
    # The same kernels called one by one from the step: the same tokens, bit for bit.
    original_init = lean.StackedLeanDecoder.__init__

    def per_kernel_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.whole_step_kernel = False

    monkeypatch.setattr(lean.StackedLeanDecoder, "__init__", per_kernel_init)
    stepped.clear()
    per_kernel = rollout.sample_agents(models, [tok] * 2, prompts, settings, keys, [None] * 2)
    assert attended and not stepped
    for a, b in zip(with_kernels, per_kernel):
        assert torch.equal(a.completion_ids, b.completion_ids)
    monkeypatch.setattr(decode_kernels, "runs", lambda tensor: False)
    with_torch = rollout.sample_agents(models, [tok] * 2, prompts, settings, keys, [None] * 2)
    for a, b in zip(with_kernels, with_torch):
        assert torch.equal(a.completion_ids, b.completion_ids)


@needs_kernel
def test_row_gather_and_scatter_are_index_select_and_index_copy():
    generator = torch.Generator().manual_seed(5)
    rows = torch.randn(40, 64, generator=generator)
    index = torch.randperm(40, generator=generator)[:25]
    gathered = decode_kernels.gather_rows(rows, index)
    assert torch.equal(gathered, rows.index_select(0, index))
    target, expected = torch.zeros(40, 64), torch.zeros(40, 64)
    decode_kernels.scatter_rows(gathered * 2, index, target)
    assert torch.equal(target, expected.index_copy_(0, index, gathered * 2))
    with pytest.raises(ValueError, match="outside the 40 rows"):
        decode_kernels.gather_rows(rows, torch.tensor([3, 40]))
    with pytest.raises(ValueError, match="contiguous fp32"):
        decode_kernels.scatter_rows(gathered, index, torch.zeros(64, 40).t())
