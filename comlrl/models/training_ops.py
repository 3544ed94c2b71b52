"""Pieces of the lean training forward (`lean.shared_prompt_logits`) with hand-written backward passes.

Autograd's generic backward of these small compositions makes many passes over the activations
(RMSNorm alone is ~14 ops: pow, mean, rsqrt, four products, their reductions) and keeps every
intermediate it touched alive until the backward pass. Written out, each piece runs a handful of
ops and keeps only what its gradient cannot cheaply recompute:

* `norm_linear`: an RMSNorm and the projection that reads it (QKV, gate/up, LM head). Keeps the
  norm's input and one scalar per row; the normalized input the projection's weight gradient
  needs is recomputed from them.
* `swiglu_linear`: SwiGLU and the down projection. Keeps SwiGLU's input; its output is recomputed.
  Where the sampling pass recorded both gate/up and down (`Replayed`), it keeps not even the input:
  `norm_linear(..., defer=True)` hands it a stand-in and its backward pass takes gate/up from the
  record (peak RSS on a Zen 4 EPYC, interleaved runs: S-medium 605-606 -> 597-600 MB in 7 pairs,
  L 674-677 -> 663-670 MB in 5; time unchanged).
* `linear`: the output projection. Keeps its input.
* `rotary`: keeps only the rotation table.
* `shared_prefix_attention` (fp32 with the C kernels): the prompt and completion attention as one
  node. Keeps the queries, keys and values in the layout its batched products read and the
  probabilities; the softmax with its padding and causal masks, and its backward pass, are one C
  pass each over the scores in place, where the torch composition concatenated the two score
  parts, added a bias tensor, split the probabilities and copied them for its products. L
  benchmark chunk (1 prompt of 48 tokens, 8 rows of 63), one layer's attention forward +
  backward: 5.6 -> 4.5 ms; the L run's peak RSS ~15 MB lower. The six products over each row's
  own tokens are causal C kernels (`decode_kernels.own_scores`, `own_weighted`, `own_transposed`;
  AVX-512, and AVX2 ones with the same sums) that skip the keys a position does not see, where
  torch.bmm multiplies every column: L's attention forward + backward ~1.14 -> ~0.92 s over the
  run (Zen 4 EPYC), 1.27 -> 1.16 s (Zen 3, AVX2). The blocked layout is gathered and scattered by
  rows of head_dim floats over cached indices (`decode_kernels.gather_rows`): the same chunk's
  forward + backward 4.47 -> 3.75 ms on Zen 3, where torch copied through permuted views.

Where fp32 products go through oneDNN (AVX-512 CPUs that are not Intel's), weight gradients come
from `decode_kernels.grad_weight`, which reads the output gradient and the input in place; oneDNN
copied both transposed first (`_weight_gradient`). In a replayed forward, SwiGLU's backward reads
gate/up's rows where the record holds them instead of a gathered copy (`Replayed.take_rows`).

Each projection's weight is joined from the model's parameters (q, k and v; gate and up) and cast
to the compute dtype in the forward pass, and joined again in the backward pass, so between the two
only the parameters themselves are referenced, not copies. Medium tiny model, one 600-token loss
chunk: 42 MB of saved activations in fp32 with a plain norm, linear and SwiGLU, 26 MB with these.

The norm and SwiGLU forwards are the transformers model's ops, bitwise, and recomputing them gives
the same values, so the logits and gradients are those of the plain composition (tested). On fp32
CPU tensors with one torch thread, the norm's forward and backward, SwiGLU's and the rotary
embedding's run as C kernels instead (`decode_kernels`: one pass over the rows each, where the
torch ops make 3-6, SwiGLU's over strided halves of gate_up), equal to the torch ops to float
rounding; the backward pass recomputes the forward's values bitwise (the norm with the same kernel
and rstd; SwiGLU's output in the same pass over gate_up that gives its gradient, through the same
sigmoid). Medium tiny model, one 528-token chunk's forward + backward: ~100 -> ~93 ms (interleaved,
noisy host). The rotary embedding is one complex multiply on pair-adjacent rows, equal to the
model's to float rounding.
"""

from __future__ import annotations

import functools
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import decode_kernels, onednn


def _kernels_take(*tensors: torch.Tensor) -> bool:
    """Whether the C kernels (`decode_kernels`) do this elementwise work: contiguous fp32 tensors on
    the CPU, one torch thread, the library built."""
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors) and decode_kernels.runs(tensors[0])


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    wide = torch.promote_types(x.dtype, torch.float32)
    return x if x.dtype == wide else x.to(wide)  # no dispatch for a no-op cast (decode hot path)


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
    def forward(ctx, x: torch.Tensor, rotation: torch.Tensor, out_dtype: torch.dtype, already_rotated: bool):
        ctx.save_for_backward(rotation)
        ctx.x_dtype = x.dtype
        if already_rotated:  # a replayed forward (see `Replayed`): x holds the rotation's output
            return x.to(out_dtype)
        rotated = _rotate_by_kernel(x, rotation, conjugate=False)
        return (rotate_pairs(x, rotation) if rotated is None else rotated).to(out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rotation,) = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _rotate_by_kernel(grad, rotation, conjugate=True)
        if grad_x is None:
            grad_x = rotate_pairs(grad, rotation.conj())
        return grad_x.to(ctx.x_dtype), None, None, None


def _rotate_by_kernel(x: torch.Tensor, rotation: torch.Tensor, conjugate: bool) -> Optional[torch.Tensor]:
    """The rotation as one C call on 3-D fp32 CPU tensors (`decode_kernels.rotate`: the complex
    product's views and casts cost more than the arithmetic); None where the kernels do not take it."""
    if x.dim() != 3 or not decode_kernels.runs(x):
        return None
    return decode_kernels.rotate(x, rotation, conjugate)  # None for a rotation it does not take (broadcast)


def rotary(x: torch.Tensor, rotation: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
           already_rotated: bool = False) -> torch.Tensor:
    """Rotary embedding of `x` (..., head_dim), rotary pairs adjacent, by `rotation` (complex,
    broadcast over x's pairs; it must not need gradients); see `rotate_pairs`. With
    `already_rotated`, x is taken as the rotation's result (from a `Replayed` projection whose
    recorded output was rotated in place) and only the backward pass rotates."""
    return _Rotary.apply(x, rotation, out_dtype or torch.promote_types(x.dtype, torch.float32), already_rotated)


def joined_weight(parts: Sequence[torch.Tensor], dtype: torch.dtype,
                  norm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The weight parts' rows (each part (rows..., columns)) stacked into one (rows, columns)
    tensor of `dtype`, with `norm` (columns,) folded into its columns when given, each part read
    once and written once. A single part without a norm is reshaped and cast only if it must be
    (a view of it when it already has `dtype`)."""
    if len(parts) == 1 and norm is None:
        part = parts[0]
        return part.reshape(-1, part.shape[-1]).to(dtype)
    rows = [p.numel() // p.shape[-1] for p in parts]
    joined = torch.empty(sum(rows), parts[0].shape[-1], dtype=dtype, device=parts[0].device)
    for target, part in zip(joined.split(rows), parts):
        if norm is None:
            target.view(part.shape).copy_(part)
        else:
            torch.mul(part, norm, out=target.view(part.shape))
    return joined


def joined_bias(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The bias parts concatenated in `dtype`; None for no parts."""
    if not parts:
        return None
    return torch.cat([p.reshape(-1) for p in parts]).to(dtype) if len(parts) > 1 else parts[0].reshape(-1).to(dtype)


def _split_like(joined: torch.Tensor, parts: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Gradients for `parts` from the gradient of their join (rows of a weight, or a bias)."""
    width = joined.shape[1] if joined.dim() == 2 else 1
    pieces = joined.split([p.numel() // width for p in parts])
    return [piece.reshape(p.shape).to(p.dtype) for piece, p in zip(pieces, parts)]


def _projection_backward(ctx, grad: torch.Tensor, x: torch.Tensor, weight_parts, bias_parts, dtype):
    """(grad of the projection's input, grads of its weight parts, grads of its bias parts) for
    y = x W^T + b, W and b joined from their parts in `dtype`."""
    weight = joined_weight(weight_parts, dtype)
    return (onednn.grad_input(grad, weight), *_parameter_grads(ctx, grad, x, weight, weight_parts, bias_parts))


def _parameter_grads(ctx, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, weight_parts, bias_parts):
    """(grads of the weight parts, grads of the bias parts) of y = x W^T + b, `weight` the joined W;
    None for the parts autograd does not want."""
    first = ctx.weights_at
    grad_weights = [None] * len(weight_parts)
    if any(ctx.needs_input_grad[first:first + len(weight_parts)]):
        grad_weights = _split_like(_weight_gradient(grad, x, weight), weight_parts)
    grad_biases = [None] * len(bias_parts)
    if bias_parts and any(ctx.needs_input_grad[first + len(weight_parts):]):
        grad_biases = _split_like(grad.sum(dim=0), bias_parts)
    return grad_weights, grad_biases


def _weight_gradient(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad^T x. Where fp32 products go through oneDNN (`onednn.FP32_THROUGH_ONEDNN`: AVX-512 on a
    CPU that is not Intel's) and the C kernels run, through `decode_kernels.grad_weight`, which reads
    both operands in place: oneDNN copies them transposed first. Zen 4 EPYC, one thread, 600 tokens:
    1024 x 256 4.13 -> 3.03 ms (76 -> 104 GFLOP/s), 256 x 512 1.74 -> 1.49 ms, 768 x 256 2.69 ->
    2.21 ms. Elsewhere `onednn.grad_weight` (MKL takes transposed operands as they are)."""
    if (onednn.FP32_THROUGH_ONEDNN and decode_kernels.AVX512_PANELS and x.dtype == torch.float32
            and grad.stride(-1) == 1 and x.stride(-1) == 1
            and weight.numel() >= onednn.MIN_WEIGHT_ELEMENTS and decode_kernels.runs(grad)):
        return decode_kernels.grad_weight(grad, x)
    return onednn.grad_weight(grad, x, weight)


class Replayed:
    """A projection's output that is already known: the same product, of the same parameters, that
    the sampling pass computed (`lean.ProjectionRecord`). `norm_linear`, `linear` and
    `swiglu_linear` given one return it as their forward result instead of multiplying again, and
    their backward passes are unchanged: they differentiate the product at the inputs the replayed
    forward computed, which equal the sampling pass's to float rounding.

    It holds a function that gathers the output, called when the forward reaches the projection,
    so that no more of it is alive at a time than of a computed output. A plain object, not a
    tensor argument of the autograd functions, so that the gathered tensor is their output and not
    a view of an input.

    With `rows`, a function that says where the output's rows already lie (int64 addresses, one per
    row, and the tensors that hold them), a consumer that reads rows in place (`swiglu_linear`'s
    backward) takes them that way instead of a gathered copy (`take_rows`)."""

    __slots__ = ("_gather", "_rows")

    def __init__(self, gather: Callable[[], torch.Tensor],
                 rows: Optional[Callable[[], Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]]] = None):
        self._gather, self._rows = gather, rows

    def take(self) -> torch.Tensor:
        gather, self._gather, self._rows = self._gather, None, None
        if gather is None:
            raise RuntimeError("a replayed projection output was already taken")
        return gather()

    def take_rows(self) -> Optional[Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]]:
        """(row addresses, the tensors holding them) in place of `take`'s copy, or None (nothing
        taken) where the source cannot say."""
        if self._gather is None:
            raise RuntimeError("a replayed projection output was already taken")
        rows, self._rows = self._rows, None
        if rows is None:
            return None
        self._gather = None
        return rows()


def _deferred(rows: int, weight_parts, dtype, device) -> torch.Tensor:
    """A (rows, out features) stand-in that holds one element, expanded: the output of a replayed
    projection whose value only a later backward pass reads, and takes from its `Replayed` there
    (`norm_linear`'s `defer`). Nothing reads it."""
    features = sum(p.numel() // p.shape[-1] for p in weight_parts)
    return torch.empty((), dtype=dtype, device=device).expand(rows, features)


def _project(x: torch.Tensor, weight_parts, bias_parts, dtype, replayed: Optional[Replayed] = None) -> torch.Tensor:
    if replayed is not None:
        out = replayed.take()
        return out.to(dtype) if out.dtype != dtype else out
    return onednn.forward(x, joined_weight(weight_parts, dtype), joined_bias(bias_parts, dtype))


class _NormLinear(torch.autograd.Function):
    """`rms_norm(x, norm_weight, eps, dtype)` (2-D x) through the projection joined from the weight
    and bias parts (cast to `dtype`). Inputs: x, norm_weight, eps, dtype, number of weight parts,
    the replayed output (or None), whether to defer it (`norm_linear`), then the weight parts and
    the bias parts."""

    @staticmethod
    def forward(ctx, x, norm_weight, eps, dtype, weight_count, replayed, defer, *parts):
        weight_parts, bias_parts = parts[:weight_count], parts[weight_count:]
        # A replayed product reads no normalized input: only the scale, which the backward reuses.
        known = replayed is not None
        normalized = None
        if _kernels_take(x, norm_weight):  # one pass over x instead of six ops
            if known:
                rstd = decode_kernels.rms_scale(x, norm_weight, eps)
            else:
                normalized, rstd = decode_kernels.rms_norm(x, norm_weight, eps)
        else:
            x32 = _at_least_fp32(x)
            rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            if not known:
                normalized = norm_weight * (x32 * rstd).to(x.dtype)
        ctx.save_for_backward(x, norm_weight, rstd, *parts)
        ctx.dtype, ctx.weight_count, ctx.weights_at, ctx.eps = dtype, weight_count, 7, eps
        if defer:  # the product is known, and only its consumer's backward pass reads it (`norm_linear`)
            return _deferred(x.shape[0], weight_parts, dtype, x.device)
        return _project(x if normalized is None else normalized.to(dtype), weight_parts, bias_parts, dtype, replayed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, norm_weight, rstd, *parts = ctx.saved_tensors
        weight_parts, bias_parts = parts[:ctx.weight_count], parts[ctx.weight_count:]
        kernels = _kernels_take(x, norm_weight)
        if kernels:  # the forward's normalized input, bitwise (same kernel, same rstd)
            normalized = decode_kernels.rms_norm(x, norm_weight, ctx.eps, rstd)[0].to(ctx.dtype)
        else:
            x_hat = _at_least_fp32(x) * rstd
            normalized = (norm_weight * x_hat.to(x.dtype)).to(ctx.dtype)
        grad_normalized, grad_weights, grad_biases = _projection_backward(
            ctx, grad, normalized, weight_parts, bias_parts, ctx.dtype)
        del normalized
        if kernels:
            grad_x, grad_norm_weight = decode_kernels.rms_norm_backward(grad_normalized.float(), x, rstd, norm_weight,
                                                                        ctx.needs_input_grad[1])
        else:
            grad_x, grad_norm_weight = _rms_norm_backward(grad_normalized, x, x_hat, rstd, norm_weight,
                                                          ctx.needs_input_grad[1])
        return (grad_x, grad_norm_weight, None, None, None, None, None, *grad_weights, *grad_biases)


def _rms_norm_backward(grad, x, x_hat, rstd, weight, weight_needs_grad: bool):
    """(grad of x, grad of weight or None) of `weight * x_hat`, x_hat = x * rstd, rstd = rsqrt(mean(x^2) + eps)."""
    grad = grad.to(x_hat.dtype)
    width = x.shape[-1]
    grad_weight = None
    if weight_needs_grad:  # sum over rows of grad * x_hat, as one multiply-reduce
        grad_weight = torch.linalg.vecdot(grad.reshape(-1, width), x_hat.reshape(-1, width), dim=0).to(weight.dtype)
    grad_normalized = grad * weight
    # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat))
    correction = torch.linalg.vecdot(grad_normalized, x_hat).unsqueeze_(-1).div_(width)
    grad_x = torch.addcmul(grad_normalized, x_hat, correction, value=-1).mul_(rstd)
    return grad_x.to(x.dtype), grad_weight


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight_parts: Sequence[torch.Tensor],
                bias_parts: Sequence[torch.Tensor] = (), dtype: Optional[torch.dtype] = None,
                replayed: Optional[Replayed] = None, defer: bool = False) -> torch.Tensor:
    """`F.linear(rms_norm(x, norm_weight, eps, dtype), W, b)` for x (..., in), W and b the weight and
    bias parts joined row-wise (each part (rows..., in) / (rows...)) and cast to `dtype` (default:
    x's dtype). Keeps only x, one scalar per row and the parts for the backward pass. With
    `replayed` (2-D, rows of x), its output is taken as the product's (see `Replayed`).

    With `defer` (and `replayed`), the output is a stand-in that holds no data: for a consumer
    that does not read it in the forward pass and takes `replayed` in its backward pass instead
    (`swiglu_linear`'s `replayed_input`). So the output is not kept from the forward to the
    backward pass: a gate/up projection's is the widest activation of a layer."""
    dtype = dtype or x.dtype
    flat = x.reshape(-1, x.shape[-1])
    if defer and replayed is None:
        raise ValueError("norm_linear: defer needs the replayed output")
    out = _NormLinear.apply(flat, norm_weight, eps, dtype, len(weight_parts), replayed, defer,
                            *weight_parts, *bias_parts)
    return out.view(*x.shape[:-1], out.shape[-1])


class _SwiGLULinear(torch.autograd.Function):
    """`swiglu(gate_up)` through the projection `weight` and `bias` (cast to `dtype`)."""

    @staticmethod
    def forward(ctx, gate_up, weight, bias, dtype, replayed, replayed_input):
        # With `replayed_input`, gate_up is `norm_linear`'s stand-in: backward takes its value from there.
        kept_gate_up = None if replayed_input is not None else gate_up
        ctx.save_for_backward(kept_gate_up, weight, *([] if bias is None else [bias]))
        ctx.dtype, ctx.weights_at, ctx.replayed_input = dtype, 1, replayed_input
        if replayed is not None:  # SwiGLU's output is only the product's input, which is known
            return _project(gate_up, [weight], [], dtype, replayed)
        if _kernels_take(gate_up):  # one pass instead of silu and a product over strided halves
            hidden = decode_kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        return _project(hidden, [weight], [] if bias is None else [bias], dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate_up, weight, *bias = ctx.saved_tensors
        in_place = None
        if ctx.replayed_input is not None:  # taken once: a second backward pass raises (`Replayed.take`)
            if ctx.dtype == torch.float32 and decode_kernels.runs(grad):  # rows read where recorded, no gather
                in_place = ctx.replayed_input.take_rows()
            if in_place is None:
                gate_up = ctx.replayed_input.take().to(ctx.dtype)
        if in_place is not None or _kernels_take(gate_up):
            # The input gradient first; then one pass over gate_up recomputes SwiGLU's output (as the
            # forward computed it, bitwise) for the weight gradient and gives gate_up's gradient.
            joined = joined_weight([weight], ctx.dtype)
            grad_hidden = onednn.grad_input(grad, joined).float()
            hidden, grad_gate_up = (decode_kernels.swiglu_backward(gate_up, grad_hidden) if in_place is None
                                    else decode_kernels.swiglu_backward_rows(*in_place, grad_hidden))
            (grad_w,), grad_bias = _parameter_grads(ctx, grad, hidden, joined, [weight], bias)
            return grad_gate_up, grad_w, (grad_bias or [None])[0], None, None, None
        gate, up = gate_up.chunk(2, dim=-1)
        silu_gate = F.silu(gate)
        grad_hidden, (grad_w,), grad_bias = _projection_backward(ctx, grad, silu_gate * up, [weight], bias, ctx.dtype)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        torch.mul(grad_hidden, silu_gate, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad_hidden * up, gate, grad_input=grad_gate)
        return grad_gate_up, grad_w, (grad_bias or [None])[0], None, None, None


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  dtype: Optional[torch.dtype] = None, replayed: Optional[Replayed] = None,
                  replayed_input: Optional[Replayed] = None) -> torch.Tensor:
    """`F.linear(swiglu(gate_up), weight, bias)` for 2-D gate_up, weight and bias cast to `dtype`
    (default: gate_up's dtype). Keeps only gate_up and the parameters for the backward pass. With
    `replayed`, its output is taken as the product's (see `Replayed`). With `replayed_input` too,
    `gate_up` is `norm_linear(..., defer=True)`'s stand-in for it: the forward pass reads neither,
    and the backward pass takes gate_up's value from `replayed_input`, so it is not kept."""
    if replayed_input is not None and replayed is None:
        raise ValueError("swiglu_linear: replayed_input needs the replayed output")
    return _SwiGLULinear.apply(gate_up, weight, bias, dtype or gate_up.dtype, replayed, replayed_input)


class _Linear(torch.autograd.Function):
    """x W^T + b, W and b joined from their parts and cast to `dtype`."""

    @staticmethod
    def forward(ctx, x, dtype, weight_count, replayed, *parts):
        ctx.save_for_backward(x, *parts)
        ctx.dtype, ctx.weight_count, ctx.weights_at = dtype, weight_count, 4
        return _project(x, parts[:weight_count], parts[weight_count:], dtype, replayed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *parts = ctx.saved_tensors
        grad_x, grad_weights, grad_biases = _projection_backward(
            ctx, grad, x, parts[:ctx.weight_count], parts[ctx.weight_count:], ctx.dtype)
        return (grad_x, None, None, None, *grad_weights, *grad_biases)


def linear(x: torch.Tensor, weight_parts: Sequence[torch.Tensor], bias_parts: Sequence[torch.Tensor] = (),
           dtype: Optional[torch.dtype] = None, replayed: Optional[Replayed] = None) -> torch.Tensor:
    """`F.linear(x, W, b)` for 2-D x, W and b joined from their parts and cast to `dtype` (default:
    x's dtype), rebuilt in the backward pass rather than kept. With `replayed`, its output is taken
    as the product's (see `Replayed`)."""
    return _Linear.apply(x, dtype or x.dtype, len(weight_parts), replayed, *weight_parts, *bias_parts)


class AttentionShape(NamedTuple):
    """The token layout `shared_prefix_attention` reads: `prompts` prompts of `width` tokens (left
    padded), then `group_size` rows per prompt of `steps` completion tokens each, rows prompt-major;
    `heads` query heads sharing `kv_heads` key/value heads of `head_dim`."""
    prompts: int
    width: int
    group_size: int
    steps: int
    heads: int
    kv_heads: int
    head_dim: int


@functools.lru_cache(maxsize=64)
def _block_rows(shape: AttentionShape, row_stride: int, first: int, count: int,
                device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Where `_blocked`'s rows are: indices into `_head_rows` of a tensor whose tokens lie
    `row_stride` heads apart, for heads first .. first + count - 1 (count = kv * n), in the order of
    the prompt part and of the completion part. A run sees a few shapes (widths are bucketed), so
    each pair is built once."""
    g, w, k, s, _, kv, d = shape
    n = count // kv
    rows = torch.arange((g * w + g * k * s) * row_stride, device=device).view(-1, row_stride)[:, first:first + count]
    # contiguous: where the permutation only moves size-1 dims, reshape returns a strided view
    prompt = rows[:g * w].reshape(g, w, kv, n).permute(0, 2, 3, 1).reshape(-1).contiguous()
    completion = rows[g * w:].reshape(g, k, s, kv, n).permute(0, 3, 1, 4, 2).reshape(-1).contiguous()
    return prompt, completion


def _head_rows(x: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """x (tokens, heads, D) with contiguous heads, token t's at a multiple of D floats apart (a
    slice of a wider projection output is), as (rows of D, the heads one token's row stride spans)."""
    tokens, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or x.stride(0) % d:
        raise ValueError(f"the attention's operands need contiguous heads of {d} floats")
    row_stride = x.stride(0) // d
    return x.as_strided(((tokens - 1) * row_stride + heads if tokens else 0, d), (d, 1)), row_stride


def _blocked(x: torch.Tensor, first: int, count: int, shape: AttentionShape) -> Tuple[torch.Tensor, torch.Tensor]:
    """(prompt part (prompts * kv, n * width, D), completion part (prompts * kv * K, n * steps, D)):
    copies of heads first .. first + count - 1 (count = kv * n) of x (tokens, heads, D, see
    `_head_rows`), each KV head's n heads as rows of its block: the layout the attention's batched
    products read. One C row gather per part (`decode_kernels.gather_rows`; at the L benchmark's
    shape ~3x faster than torch's copies through permuted views)."""
    g, w, k, s, _, kv, d = shape
    n = count // kv
    rows, row_stride = _head_rows(x)
    prompt_rows, completion_rows = _block_rows(shape, row_stride, first, count, x.device)
    return (decode_kernels.gather_rows(rows, prompt_rows, check=False).view(g * kv, n * w, d),
            decode_kernels.gather_rows(rows, completion_rows, check=False).view(g * kv * k, n * s, d))


def _unblock(prompt: torch.Tensor, completion: torch.Tensor, shape: AttentionShape, out: torch.Tensor,
             first: int, count: int) -> None:
    """Writes `_blocked`'s two parts back into heads first .. first + count - 1 of `out` (tokens,
    heads, D, see `_head_rows`)."""
    rows, row_stride = _head_rows(out)
    prompt_rows, completion_rows = _block_rows(shape, row_stride, first, count, out.device)
    d = rows.shape[1]
    decode_kernels.scatter_rows(prompt.reshape(-1, d).contiguous(), prompt_rows, rows, check=False)
    decode_kernels.scatter_rows(completion.reshape(-1, d).contiguous(), completion_rows, rows, check=False)


#: Whether the products over the rows' own tokens run as `decode_kernels`' causal ones (False:
#: `torch.bmm` over every column, which the tests compare them with).
OWN_TOKEN_KERNELS = True


def _own_kernels(blocks: int, period: int) -> bool:
    """Whether the products over the rows' own tokens (`blocks` blocks of `period` keys) run as
    `decode_kernels`' causal ones (at least one block and one step; AVX-512 or AVX2 kernels, which
    agree bit for bit) rather than `torch.bmm` over every column."""
    return OWN_TOKEN_KERNELS and blocks > 0 and period > 0


def _own_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """queries (blocks, heads * period, D) . keys (blocks, period, D)^T, the causal part at least."""
    if _own_kernels(keys.shape[0], keys.shape[1]):
        return decode_kernels.own_scores(queries, keys)
    return torch.bmm(queries, keys.transpose(1, 2))


def _own_weighted(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """weights (blocks, heads * period, period), 0 past each row's position, . values (blocks, period, D)."""
    if _own_kernels(values.shape[0], values.shape[1]):
        return decode_kernels.own_weighted(weights, values)
    return torch.bmm(weights, values)


def _own_transposed(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weights^T (blocks, period, heads * period) . x (blocks, heads * period, D), weights as above."""
    if _own_kernels(weights.shape[0], weights.shape[2]):
        return decode_kernels.own_transposed(weights, x)
    return torch.bmm(weights.transpose(1, 2), x)


class _SharedPrefixAttention(torch.autograd.Function):
    """See `shared_prefix_attention`. Saves the queries, keys and values in the blocked layout and the
    probabilities; the backward pass runs the products' transposes and one C pass for the softmax."""

    @staticmethod
    def forward(ctx, query_key, value, prompt_bias, prefix_bias, shape: AttentionShape, scale: float):
        g, w, k, s, heads, kv, d = shape
        group = heads // kv
        q_prompt, q_completion = _blocked(query_key, 0, heads, shape)
        k_prompt, k_completion = _blocked(query_key, heads, kv, shape)
        v_prompt, v_completion = _blocked(value, 0, kv, shape)
        q_rows = q_completion.view(g * kv, k * group * s, d)  # all K rows' queries of a prompt and KV head

        # Prompts: causal self-attention (prompt_bias). Completions: the prompt's keys (prefix_bias
        # masks its padding) and their own earlier tokens (causal in the kernel), one softmax.
        prompt_probs = torch.bmm(q_prompt, k_prompt.transpose(1, 2))
        decode_kernels.attention_softmax(prompt_probs, None, g * kv, w, prompt_bias, scale)
        prefix_probs = torch.bmm(q_rows, k_prompt.transpose(1, 2))
        own_probs = _own_scores(q_completion, k_completion)
        decode_kernels.attention_softmax(prefix_probs, own_probs, g * kv * k, s, prefix_bias, scale)

        attended_prompt = torch.bmm(prompt_probs, v_prompt)
        attended = _own_weighted(own_probs, v_completion)
        attended.view(g * kv, k * group * s, d).baddbmm_(prefix_probs, v_prompt)
        out = query_key.new_empty(query_key.shape[0], heads, d)
        _unblock(attended_prompt, attended, shape, out, 0, heads)
        ctx.save_for_backward(q_prompt, q_completion, k_prompt, k_completion, v_prompt, v_completion,
                              prompt_probs, prefix_probs, own_probs)
        ctx.shape, ctx.scale = shape, scale
        return out.view(query_key.shape[0], heads * d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (q_prompt, q_completion, k_prompt, k_completion, v_prompt, v_completion,
         prompt_probs, prefix_probs, own_probs) = ctx.saved_tensors
        shape, scale = ctx.shape, ctx.scale
        g, w, k, s, heads, kv, d = shape
        group = heads // kv
        grad_prompt, grad_completion = _blocked(grad.reshape(-1, heads, d), 0, heads, shape)
        grad_rows = grad_completion.view(g * kv, k * group * s, d)
        q_rows = q_completion.view(g * kv, k * group * s, d)

        # Values: probabilities^T x output gradient.
        grad_v_prompt = torch.bmm(prefix_probs.transpose(1, 2), grad_rows)
        grad_v_prompt.baddbmm_(prompt_probs.transpose(1, 2), grad_prompt)
        grad_v_completion = _own_transposed(own_probs, grad_completion)
        # Scores: output gradient x values^T, through the softmax (in place).
        grad_prompt_scores = torch.bmm(grad_prompt, v_prompt.transpose(1, 2))
        decode_kernels.attention_softmax_backward(prompt_probs, grad_prompt_scores, None, None, g * kv, w, scale)
        grad_prefix_scores = torch.bmm(grad_rows, v_prompt.transpose(1, 2))
        grad_own_scores = _own_scores(grad_completion, v_completion)
        decode_kernels.attention_softmax_backward(prefix_probs, grad_prefix_scores, own_probs, grad_own_scores,
                                                  g * kv * k, s, scale)
        # Queries and keys from the score gradients.
        grad_q_prompt = torch.bmm(grad_prompt_scores, k_prompt)
        grad_q_completion = _own_weighted(grad_own_scores, k_completion)
        grad_q_completion.view(g * kv, k * group * s, d).baddbmm_(grad_prefix_scores, k_prompt)
        grad_k_prompt = torch.bmm(grad_prefix_scores.transpose(1, 2), q_rows)
        grad_k_prompt.baddbmm_(grad_prompt_scores.transpose(1, 2), q_prompt)
        grad_k_completion = _own_transposed(grad_own_scores, q_completion)

        tokens = grad.shape[0]
        grad_query_key = grad.new_empty(tokens, heads + kv, d)
        _unblock(grad_q_prompt, grad_q_completion, shape, grad_query_key, 0, heads)
        _unblock(grad_k_prompt, grad_k_completion, shape, grad_query_key, heads, kv)
        grad_value = grad.new_empty(tokens, kv, d)
        _unblock(grad_v_prompt, grad_v_completion, shape, grad_value, 0, kv)
        return grad_query_key, grad_value, None, None, None, None


def shared_prefix_attention(query_key: torch.Tensor, value: torch.Tensor, prompt_bias: torch.Tensor,
                            prefix_bias: torch.Tensor, shape: AttentionShape, scale: float) -> torch.Tensor:
    """The training forward's attention (`lean.shared_prompt_logits`) as one autograd node:
    `query_key` (tokens, heads + kv_heads, head_dim), rotated, contiguous, and `value` (tokens,
    kv_heads, head_dim) of the tokens in `shape`'s layout; returns the attended values (tokens,
    heads * head_dim).

    Each prompt's queries attend causally to its own tokens (`prompt_bias` (prompts, width, width),
    additive, 0 or -inf). Each completion token attends to its prompt's tokens (`prefix_bias`
    (prompts, 1, width), additive: -inf at padding) and to its row's tokens up to itself, in one
    softmax. The products are batched matmuls in which a KV head's query heads are rows (no repeat
    of keys or values) and all K rows of a prompt share one product against its keys, forward and
    backward. The softmax, its masks and its backward pass are C passes over the scores in place
    (`decode_kernels.attention_softmax`), so none of the torch composition's concatenation, bias
    add, split and copies of the probabilities run. fp32 where `decode_kernels.runs`."""
    return _SharedPrefixAttention.apply(query_key, value, prompt_bias, prefix_bias, shape, scale)
