"""The hand-written backward passes of the lean training forward's pieces are the true gradients,
and the pieces keep only what they say they keep."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, rotate_half

from comlrl.models import decode_kernels, onednn, training_ops


def _model_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = Qwen2RMSNorm(x.shape[-1], eps=eps)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm(x)


def _double(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _model_norm_linear(x, norm_weight, weights, biases, dtype=None):
    """The plain composition: the transformers norm, then F.linear with the joined weight."""
    normed = _model_norm(x, norm_weight, 1e-6)
    weight = torch.cat([w.reshape(-1, w.shape[-1]) for w in weights])
    bias = torch.cat([b.reshape(-1) for b in biases]) if biases else None
    if dtype is not None:
        normed, weight, bias = normed.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    return F.linear(normed, weight, bias)


def _parts(seed: int):
    """Weight and bias parts of one projection of 8 inputs: a (2, 2, 3, 8) view that is not
    contiguous (as the pair-adjacent query rows are) and a plain (5, 8) one."""
    first, second = _double(3, 2, 2, 8, seed=seed).transpose(0, 2), _double(5, 8, seed=seed + 1)
    first_bias, second_bias = _double(3, 2, 2, seed=seed + 2).transpose(0, 2), _double(5, seed=seed + 3)
    return [first, second], [first_bias, second_bias]


def test_norm_linear_is_the_norm_then_the_joined_projection_and_passes_gradcheck(monkeypatch):
    x, norm_weight = _double(5, 3, 8, seed=0), _double(8, seed=1)
    weights, biases = _parts(seed=10)
    inputs = [t.detach().requires_grad_() for t in (x, norm_weight, *weights, *biases)]
    assert torch.autograd.gradcheck(
        lambda a, w, p, q, b, c: training_ops.norm_linear(a, w, 1e-6, [p, q], [b, c]), inputs)
    # In the model's dtype the torch ops are the transformers norm and F.linear, bitwise (the C
    # kernels, which take fp32 where they run, agree to float rounding: tested below).
    monkeypatch.setattr(decode_kernels, "runs", lambda tensor: False)
    x, norm_weight = x.float(), norm_weight.float()
    weights, biases = [w.float() for w in weights], [b.float() for b in biases]
    got = training_ops.norm_linear(x, norm_weight, 1e-6, weights, biases)
    assert got.shape == (5, 3, 17)
    assert torch.equal(got, _model_norm_linear(x, norm_weight, weights, biases))
    low = training_ops.norm_linear(x, norm_weight, 1e-6, weights, biases, torch.bfloat16)
    assert low.dtype == torch.bfloat16
    assert torch.equal(low, _model_norm_linear(x, norm_weight, weights, biases, torch.bfloat16))


def test_swiglu_linear_is_silu_gate_times_up_through_the_weight_and_passes_gradcheck(monkeypatch):
    gate_up, weight = _double(6, 12, seed=2).requires_grad_(), _double(4, 6, seed=3).requires_grad_()
    assert torch.autograd.gradcheck(training_ops.swiglu_linear, (gate_up, weight))
    monkeypatch.setattr(decode_kernels, "runs", lambda tensor: False)  # the torch ops, bitwise (kernels: below)
    gate, up = gate_up.detach().float().chunk(2, dim=-1)
    got = training_ops.swiglu_linear(gate_up.detach().float(), weight.detach().float())
    assert torch.equal(got, F.linear(F.silu(gate) * up, weight.detach().float()))


def test_linear_of_joined_parts_passes_gradcheck():
    x = _double(4, 8, seed=5).requires_grad_()
    weights, biases = _parts(seed=20)
    inputs = [t.detach().requires_grad_() for t in (*weights, *biases)]
    assert torch.autograd.gradcheck(lambda a, p, q, b, c: training_ops.linear(a, [p, q], [b, c]), [x, *inputs])


def test_projections_keep_only_their_inputs_the_norm_scale_and_the_parameters():
    """What makes the lean forward lean on memory: neither the normalized input, nor SwiGLU's
    output, nor a joined or cast weight is kept for the backward pass."""
    x = torch.randn(10, 8)
    norm_weight, weight, down = (torch.randn(*shape, requires_grad=True) for shape in ((8,), (12, 8), (4, 6)))
    kept = []

    def keep(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        gate_up = training_ops.norm_linear(x, norm_weight, 1e-6, [weight[:6], weight[6:]], (), torch.bfloat16)
        training_ops.swiglu_linear(gate_up, down, dtype=torch.bfloat16).float().sum().backward()
    allowed = {t.untyped_storage().data_ptr() for t in (x, norm_weight, weight, down, gate_up)}
    rstd = [t for t in kept if t.untyped_storage().data_ptr() not in allowed]
    assert len(rstd) == 1 and rstd[0].shape == (10, 1)  # the norm's one scalar per row


@pytest.mark.parametrize("kernels", [True, False])
def test_a_deferred_gate_up_is_not_kept_and_gives_the_same_gradients(kernels, monkeypatch):
    """With gate/up and down replayed, `norm_linear(defer=True)` hands SwiGLU a stand-in and
    SwiGLU's backward takes gate/up from its Replayed: same output and gradients, bitwise, as the
    pair fed the replayed tensors directly, and no (rows, 2 * intermediate) tensor is kept."""
    if not kernels:
        monkeypatch.setattr(decode_kernels, "runs", lambda tensor: False)
    x = torch.randn(10, 8)
    norm_weight, weight, down = (torch.randn(*shape, requires_grad=True) for shape in ((8,), (12, 8), (4, 6)))
    known_gate_up, known_down = torch.randn(10, 12), torch.randn(10, 4)

    def run(defer: bool):
        kept = []

        def keep(t):
            kept.append(tuple(t.shape))
            return t

        gate_up_source = training_ops.Replayed(lambda: known_gate_up.clone())
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            gate_up = training_ops.norm_linear(x, norm_weight, 1e-6, [weight[:6], weight[6:]], (), None,
                                               gate_up_source, defer=defer)
            out = training_ops.swiglu_linear(gate_up, down, None, None, training_ops.Replayed(lambda: known_down.clone()),
                                             replayed_input=gate_up_source if defer else None)
        grads = torch.autograd.grad((out * torch.arange(4.0)).sum(), (norm_weight, weight, down))
        return out.detach(), grads, kept

    out, grads, kept = run(defer=True)
    expected_out, expected_grads, expected_kept = run(defer=False)
    assert torch.equal(out, expected_out) and torch.equal(out, known_down)
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want)
    assert (10, 12) in expected_kept and (10, 12) not in kept
    # The replayed gate/up is taken once: a second backward pass through the graph says so.
    source = training_ops.Replayed(lambda: known_gate_up.clone())
    gate_up = training_ops.norm_linear(x, norm_weight, 1e-6, [weight[:6], weight[6:]], (), None, source, defer=True)
    out = training_ops.swiglu_linear(gate_up, down, None, None, training_ops.Replayed(lambda: known_down.clone()),
                                     replayed_input=source)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already taken"):
        out.sum().backward()
    with pytest.raises(ValueError, match="defer needs"):
        training_ops.norm_linear(x, norm_weight, 1e-6, [weight], (), defer=True)
    with pytest.raises(ValueError, match="replayed_input needs"):
        training_ops.swiglu_linear(known_gate_up, down, replayed_input=training_ops.Replayed(lambda: known_gate_up))


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


needs_kernel = pytest.mark.skipif(decode_kernels.library() is None,
                                  reason="the C kernels need an x86-64 CPU with AVX2 and FMA and a C compiler")


@needs_kernel
def test_rms_scale_is_rms_norms_scale_bitwise():
    """A replayed projection's norm computes only its scale (`decode_kernels.rms_scale`), which the
    backward pass reuses to recompute the normalized input: it must be `rms_norm`'s, bit for bit."""
    x, weight = torch.randn(37, 259) * 2, 1 + 0.1 * torch.randn(259)
    normalized, rstd = decode_kernels.rms_norm(x, weight, 1e-6)
    scale = decode_kernels.rms_scale(x, weight, 1e-6)
    assert scale.shape == (37, 1) and torch.equal(scale, rstd)
    assert torch.equal(decode_kernels.rms_norm(x, weight, 1e-6, scale)[0], normalized)


def _forward_and_grads(fn, inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), [t.grad for t in inputs]


@needs_kernel
@pytest.mark.parametrize("piece", ["norm_linear", "swiglu_linear", "rotary"])
def test_c_kernels_compute_the_fp32_pieces_as_the_torch_ops_do(piece, monkeypatch):
    """In fp32 on the CPU the norm, SwiGLU and rotary embedding (forward, recomputation, backward)
    run as C kernels (`decode_kernels`); values and gradients agree with the torch ops to float
    rounding."""
    generator = torch.Generator().manual_seed(7)
    if piece == "norm_linear":
        width = 259  # 32 vectors of 8 and a scalar tail
        inputs = [torch.randn(37, width, generator=generator) * 2, 1 + 0.1 * torch.randn(width, generator=generator),
                  torch.randn(48, width, generator=generator) * 0.05, torch.randn(24, width, generator=generator) * 0.05]
        fn = lambda x, w, p, q: training_ops.norm_linear(x, w, 1e-6, [p, q])  # noqa: E731
        kernel = "rms_norm_backward"
    elif piece == "swiglu_linear":
        inputs = [torch.randn(37, 2 * 99, generator=generator) * 3, torch.randn(64, 99, generator=generator) * 0.05]
        fn = training_ops.swiglu_linear
        kernel = "swiglu_backward"
    else:
        angles = torch.randn(37, 1, 32, generator=generator)
        rotation = torch.polar(torch.ones_like(angles), angles)
        inputs = [torch.randn(37, 6, 64, generator=generator)]
        fn = lambda x: training_ops.rotary(x, rotation)  # noqa: E731
        kernel = "rotate"
    calls, original = [], getattr(decode_kernels, kernel)
    monkeypatch.setattr(decode_kernels, kernel, lambda *a: calls.append(1) or original(*a))
    with_kernels, kernel_grads = _forward_and_grads(fn, inputs)
    assert calls, "the fp32 backward did not run the C kernel"
    monkeypatch.setattr(decode_kernels, "runs", lambda tensor: False)
    with_torch, torch_grads = _forward_and_grads(fn, inputs)
    torch.testing.assert_close(with_kernels, with_torch, rtol=1e-5, atol=1e-5)
    for got, expected in zip(kernel_grads, torch_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not (onednn.FP32_THROUGH_ONEDNN and decode_kernels.AVX512_PANELS
                         and decode_kernels.library() is not None),
                    reason="the weight-gradient kernel replaces oneDNN's on AVX-512 CPUs that are not Intel's")
@pytest.mark.parametrize("piece", ["norm_linear", "swiglu_linear", "linear"])
def test_large_weight_gradients_run_the_in_place_kernel_and_equal_onednns(piece, monkeypatch):
    """fp32 weights of at least `onednn.MIN_WEIGHT_ELEMENTS` get their gradient from
    `decode_kernels.grad_weight` (both operands read in place) instead of oneDNN's transposed
    copies; it is the same gradient to float rounding, for every projection of the training pass."""
    generator = torch.Generator().manual_seed(3)
    rows, width = 300, 256
    if piece == "norm_linear":
        inputs = [torch.randn(rows, width, generator=generator), 1 + 0.1 * torch.randn(width, generator=generator),
                  torch.randn(512, width, generator=generator) * 0.05, torch.randn(256, width, generator=generator) * 0.05]
        fn = lambda x, w, p, q: training_ops.norm_linear(x, w, 1e-6, [p, q])  # noqa: E731
    elif piece == "swiglu_linear":
        inputs = [torch.randn(rows, 2 * 512, generator=generator), torch.randn(width, 512, generator=generator) * 0.05]
        fn = training_ops.swiglu_linear
    else:
        inputs = [torch.randn(rows, width, generator=generator), torch.randn(width, width, generator=generator) * 0.05]
        fn = lambda x, w: training_ops.linear(x, [w])  # noqa: E731
    calls, original = [], decode_kernels.grad_weight
    monkeypatch.setattr(decode_kernels, "grad_weight", lambda *a: calls.append(1) or original(*a))
    _, kernel_grads = _forward_and_grads(fn, inputs)
    assert calls, "the weight gradient did not run the kernel"
    monkeypatch.setattr(training_ops, "_weight_gradient", onednn.grad_weight)  # oneDNN's, transposed copies
    _, onednn_grads = _forward_and_grads(fn, inputs)
    for got, expected in zip(kernel_grads, onednn_grads):  # sums over 300 rows: 1e-4 of rounding
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _attention_inputs(prompts, width, k, steps, heads, kv_heads, head_dim, padding, seed):
    """Rotated queries/keys and values of `prompts` left-padded prompts and their K rows, with the
    masks `lean.shared_prompt_logits` builds for both attention paths."""
    from comlrl.models import lean

    generator = torch.Generator().manual_seed(seed)
    tokens = prompts * width + prompts * k * steps
    mask = torch.ones(prompts, width, dtype=torch.long)
    for prompt, pad in enumerate(padding):
        mask[prompt, :pad] = 0
    real = mask.bool()
    prompt_bias = lean._prompt_bias(mask, torch.float32)
    prefix_bias = torch.zeros(prompts, 1, width).masked_fill_(~real[:, None, :], float("-inf"))
    completion_bias = torch.zeros(prompts, steps, width + steps)
    completion_bias[:, :, :width].masked_fill_(~real[:, None, :], float("-inf"))
    completion_bias[:, :, width:].masked_fill_(~torch.ones(steps, steps, dtype=torch.bool).tril(), float("-inf"))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator) * 2
    shape = training_ops.AttentionShape(prompts, width, k, steps, heads, kv_heads, head_dim)
    return qkv, shape, prompt_bias, prefix_bias, completion_bias[:, None, None, None]


@needs_kernel
@pytest.mark.parametrize("layout", [
    dict(prompts=1, width=12, k=4, steps=9, heads=4, kv_heads=2, head_dim=16, padding=[3]),
    dict(prompts=3, width=9, k=2, steps=17, heads=6, kv_heads=2, head_dim=8, padding=[2, 0, 8]),  # 8: one real token
    dict(prompts=2, width=5, k=3, steps=1, heads=4, kv_heads=4, head_dim=8, padding=[0, 1]),  # MHA, one step
    dict(prompts=2, width=5, k=2, steps=0, heads=4, kv_heads=1, head_dim=8, padding=[1, 0]),  # prompts only
])
@pytest.mark.parametrize("own_products", ["avx2", "avx512", "bmm"])
def test_fused_attention_computes_the_composed_attention_and_its_gradients(layout, own_products, monkeypatch):
    """In fp32 with the C kernels, the training forward's attention is one autograd node whose
    softmax and masks are C passes (`shared_prefix_attention`); its output and the gradients of the
    queries, keys and values agree with the torch composition it replaces to float rounding, with
    the products over each row's own tokens as causal C kernels (AVX2, or AVX-512 where the CPU has
    it) or as torch.bmm."""
    from comlrl.models import lean

    if own_products == "avx512" and not decode_kernels.AVX512_PANELS:
        pytest.skip("the AVX-512 own-token kernels need a CPU that runs them")
    if own_products == "avx2":
        monkeypatch.setattr(decode_kernels, "AVX512_PANELS", False)  # AVX2 code runs on AVX-512 CPUs too
    causal_kernels = own_products != "bmm"
    monkeypatch.setattr(training_ops, "OWN_TOKEN_KERNELS", causal_kernels)
    own_calls, own_scores = [], decode_kernels.own_scores
    monkeypatch.setattr(decode_kernels, "own_scores", lambda *a: own_calls.append(1) or own_scores(*a))

    qkv, shape, prompt_bias, prefix_bias, completion_bias = _attention_inputs(**layout, seed=11)
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    calls, original = [], decode_kernels.attention_softmax_backward
    monkeypatch.setattr(decode_kernels, "attention_softmax_backward", lambda *a: calls.append(1) or original(*a))
    results = []
    for fused in (True, False):
        leaf = qkv.clone().requires_grad_()
        query_key, value = leaf.split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
        query_key = query_key.reshape(-1, heads + kv_heads, head_dim).contiguous()  # as the rotary returns it
        value = value.view(-1, kv_heads, head_dim)  # strided, as split from the QKV output
        if fused:
            out = training_ops.shared_prefix_attention(query_key, value, prompt_bias.view(shape.prompts, shape.width, -1),
                                                       prefix_bias, shape, head_dim ** -0.5)
        else:
            out = lean._composed_attention(query_key, value, shape, prompt_bias, completion_bias, head_dim ** -0.5,
                                           torch.float32)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out.detach(), leaf.grad))
    assert calls, "the fused attention's backward did not run the C softmax kernel"
    assert bool(own_calls) == (causal_kernels and shape.steps > 0)
    (fused_out, fused_grad), (composed_out, composed_grad) = results
    assert fused_out.shape == (qkv.shape[0], heads * head_dim)
    torch.testing.assert_close(fused_out, composed_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grad, composed_grad, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_attention_softmax_masks_causally_and_sums_to_one():
    """The C softmax: a completion query at step s sees its prompt's real tokens and its own tokens
    0 .. s; the rest get probability 0 (exactly), the seen ones sum to 1."""
    blocks, steps, width = 2, 5, 4
    prefix, own = torch.randn(blocks, steps, width), torch.randn(blocks, steps, steps)
    bias = torch.tensor([[[float("-inf"), 0.0, 0.0, 0.0]]])
    decode_kernels.attention_softmax(prefix, own, blocks, steps, bias, 0.5)
    assert bool((prefix[..., 0] == 0).all())
    seen = torch.ones(steps, steps, dtype=torch.bool).tril()
    assert bool((own[:, ~seen] == 0).all()) and bool((own[:, seen] > 0).all())
    torch.testing.assert_close(prefix.sum(-1) + own.sum(-1), torch.ones(blocks, steps))
