"""fp32 work on the CPU that torch runs as many small ops: C kernels for the decode step (its
projections, attention, rotary embedding + cache write, residual adds + norms, SwiGLU, and the
top-k sampler) and for the training pass's norms, SwiGLU and rotary embedding (`training_ops`);
on AVX-512 CPUs also the training pass's weight gradients (`grad_weight`, no transposed copies)
and its attention products over each row's own tokens (`own_scores` and the two below it, causal).

A decode step multiplies 8-32 rows per agent by every weight of the model, and each weight is
reused for every step of a sampling call. MKL's sgemm, which `torch.bmm` runs on the CPU, does
poorly at that shape where it runs its AVX2 code (any AMD CPU, or an Intel one without AVX-512):
it re-packs the weight on every call and reaches 18-33 GFLOP/s on one core of an AVX2-only AMD
EPYC (Zen 3). `decode_kernels.c` packs each weight once per sampling call into 8-wide column
panels and streams them through an 8 x 8 register-blocked AVX2 kernel (each panel read once for
8 rows). Measured on that core, one medium-model decode step's projections (2 agents, every
weight once, weights out of cache as in a real step): 2.6 -> 1.3 ms with 8 rows per agent, 3.4 ->
2.5 ms with 16. The step's attention (shared prompt keys, each row's own keys, one softmax) is one
C call per layer in place of ~40 small torch ops. A 2-agent medium-model sampling call (64
tokens): 410 -> 256 ms at K=4, 545 -> 404 ms at K=8 on the EPYC; on an Intel Xeon with AVX-512
and AMX, against oneDNN's packed fp32 kernels, 243 -> 167 ms and 310 -> 256 ms.

Panels are 16 wide by default. On AVX2 CPUs a pass takes 6 rows (12 of the 16 vector registers
hold sums, where 8 x 8 kept the FMA units' latency with no slack): on the EPYC one K=8 sampling
call's products 165 -> 148 ms, the prefill's ~114 rows 62 -> 78 GFLOP/s. On CPUs with AVX-512 a
pass takes up to 16 rows (16 of the 32 vector registers hold sums), so at 16 rows per agent each
panel is read once. On the Xeon, one step's projections 1.70 -> 1.14 ms at 16 rows per agent
(89 -> 132 GFLOP/s) and 0.95 -> 0.80 ms at 8; the sampling call above 177 -> 161 ms (K=4) and 270 -> 230 ms (K=8), same tokens: all
kernel families sum in the same order, so their results are equal bit for bit.

Around the products, each small torch op of a step cost 5-30 us in place (caches cold from
streaming the weights), so the step's remaining elementwise work is C too: a residual add and the
norm after it in one call, SwiGLU in one, the rotary embedding with the K/V cache write in one,
and the draw (temperature, top-k, top-p, inverse CDF) in one. The attention kernel runs four
8-column blocks and a KV head's two query heads per pass (one block at a time, each sum waited on
the FMA latency), with masked tails, same sums bit for bit: 113 -> 58 us per call at 2 agents x 16
rows. On the Xeon, one 2-agent medium-model sampling call went 171 -> ~132 ms (K=4) and 249 ->
~180 ms (K=8) with all of these; the draw alone 18.5 -> 10.2 ms per K=8 call.

Where all of a step's parts run here (fp32 throughout, every projection on panels), the whole step
is one C call (`DecodeStepPlan`, `comlrl_decode_step`): the same kernels in the same order, so the
logits, the cache and the recorded projections are bitwise those of the per-kernel calls, without
the ~40 Python-side calls per step around them (each 5-15 us of argument checks, `data_ptr`s and
new tensors). An L benchmark sampling call, 2 agents x 16 rows x 64 tokens, ~213 -> ~187 ms at the
best of 16 calls; L interleaved with the per-kernel step, 6 pairs: median 10.31 -> 9.79 s.

Where they run: fp32 tensors on the CPU with one torch thread (the kernels are single-threaded;
with more threads MKL and oneDNN split the work instead), on a CPU with AVX2 and FMA, and the
AVX-512 products where PyTorch reports AVX-512. The library is compiled once per machine with the
system C compiler (`cc -O3 -mavx2 -mfma`, about a second; the AVX-512 functions carry their own
target attribute) into `$COMLRL_KERNEL_CACHE` (default `~/.cache/comlrl/kernels`); `make install`
builds it. Without a compiler, or with `COMLRL_DECODE_KERNELS=0`, torch ops do all of this.

The kernels sum each row's products in input order, one fused multiply-add at a time, so a row's
result does not depend on how many rows share the call (the products do not tie a sample to its batch),
and it differs from MKL's only by float rounding (tested against `torch.bmm`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .onednn import cpu_capability

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_kernels.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC"]
_ALIGN_FLOATS = 16  # 64 bytes: the AVX2 kernels' aligned loads, a cache line per AVX-512 panel row


#: Outputs per panel: 6 (NR6 in decode_kernels.c, AVX2), 8 (NR, AVX2) or 16 (NR16), the default,
#: which runs the AVX-512 kernels where PyTorch runs AVX-512 code (it checks the OS saves the
#: registers too), else 16-wide AVX2 ones. Every family gives the same results, bit for bit.
PANEL_WIDTHS = (6, 8, 16)
PANEL_WIDTH = 16
AVX512_PANELS = cpu_capability() == "AVX512"


def panel_width(rows: Optional[int] = None) -> int:
    """The panel width for decode steps of `rows` rows per agent. 6 on AVX2 CPUs at whole blocks of
    16 rows, where each step streams every weight once through 6 x 16 register blocks instead of
    reading each 16-wide panel once per 6 + 6 + 4 rows (L-shaped sampling calls on an AVX2 EPYC,
    widths alternating in one process: the products' `perf` samples -10%, steps' median 257 -> 248
    ms). At 8, 12 or 24 rows the 16-wide kernels were the faster (8 rows: 0.80 against 0.90 ms per
    step's products at best), so elsewhere `PANEL_WIDTH`."""
    if not AVX512_PANELS and rows is not None and rows > 0 and rows % 16 == 0:
        return 6
    return PANEL_WIDTH


def cache_dir() -> Path:
    """Where the compiled library lives: `$COMLRL_KERNEL_CACHE`, else `~/.cache/comlrl/kernels`."""
    env = os.environ.get("COMLRL_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "comlrl" / "kernels"


def _cpu_supports_kernel() -> bool:
    """x86-64 with AVX2 and FMA (PyTorch reports AVX2 only when both are there)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return cpu_capability() in ("AVX2", "AVX512")


def build(directory: Optional[Path] = None) -> Optional[Path]:
    """Compile decode_kernels.c for this machine unless already compiled; returns the library's path,
    or None when there is no C compiler or it fails. Safe to run from several processes at once:
    each compiles into a temporary file and renames it into place."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"decode_kernels-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        log.info("decode_kernels: no C compiler found; decode projections use torch.bmm")
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            partial = Path(scratch) / target.name
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)], check=True,
                           capture_output=True, timeout=120)
            os.replace(partial, target)
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        log.warning("decode_kernels: compiling %s failed (%s %s); decode projections use torch.bmm",
                    SOURCE.name, error, detail.decode(errors="replace")[-500:])
        return None
    return target


_library: Optional[ctypes.CDLL] = None
_loaded = False


def library() -> Optional[ctypes.CDLL]:
    """The kernel library (built on first use), or None where it cannot run here."""
    global _library, _loaded
    if _loaded:
        return _library
    _loaded = True
    if os.environ.get("COMLRL_DECODE_KERNELS", "1") == "0" or not _cpu_supports_kernel():
        return None
    path = build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        log.warning("decode_kernels: cannot load %s (%s); decode projections use torch.bmm", path, error)
        return None
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    lib.comlrl_pack_panels.argtypes = [pointer, pointer, i64, i64, pointer, i64]
    lib.comlrl_pack_panels.restype = None
    lib.comlrl_panel_gemm.argtypes = [i64, i64, i64, i64, pointer, i64, i64, pointer, i64, pointer, i64,
                                      pointer, i64, i64, i64, i64]
    lib.comlrl_panel_gemm.restype = ctypes.c_int
    lib.comlrl_decode_attention.argtypes = [i64, i64, i64, i64, i64, pointer, i64, pointer, pointer, i64, pointer,
                                            pointer, i64, i64, pointer, i64, ctypes.c_float, pointer, pointer]
    lib.comlrl_decode_attention.restype = None
    lib.comlrl_decode_attention_scratch_floats.argtypes = [i64] * 4
    lib.comlrl_decode_attention_scratch_floats.restype = i64
    lib.comlrl_residual_rms_norm.argtypes = [i64, i64, pointer, pointer, ctypes.c_float, pointer]
    lib.comlrl_residual_rms_norm.restype = None
    lib.comlrl_silu_mul.argtypes = [i64, i64, pointer, pointer]
    lib.comlrl_silu_mul.restype = None
    lib.comlrl_rotate_into_cache.argtypes = [i64, i64, i64, i64, pointer, i64, pointer, pointer, pointer, i64, i64]
    lib.comlrl_rotate_into_cache.restype = None
    lib.comlrl_swiglu_backward.argtypes = [i64, i64, pointer, pointer, pointer, pointer, pointer]
    lib.comlrl_swiglu_backward.restype = None
    lib.comlrl_rms_norm.argtypes = [i64, i64, pointer, pointer, ctypes.c_float, pointer, pointer, pointer]
    lib.comlrl_rms_norm.restype = None
    lib.comlrl_rms_norm_backward.argtypes = [i64, i64, pointer, pointer, pointer, pointer, pointer, pointer]
    lib.comlrl_rms_norm_backward.restype = None
    lib.comlrl_draw_tokens.argtypes = [i64, i64, pointer, i64, pointer, i64, ctypes.c_float, ctypes.c_float, pointer,
                                       pointer, pointer, pointer]
    lib.comlrl_draw_tokens.restype = None
    lib.comlrl_gather_rows.argtypes = lib.comlrl_scatter_rows.argtypes = [i64, i64, pointer, pointer, pointer]
    lib.comlrl_gather_rows.restype = lib.comlrl_scatter_rows.restype = None
    lib.comlrl_rotate.argtypes = [i64, i64, i64, pointer, i64, pointer, i64, pointer]
    lib.comlrl_rotate.restype = None
    lib.comlrl_attention_softmax.argtypes = [i64, i64, i64, pointer, i64, pointer, i64, i64, i64, pointer, i64,
                                             ctypes.c_float]
    lib.comlrl_attention_softmax.restype = None
    lib.comlrl_attention_softmax_backward.argtypes = [i64, i64, i64, pointer, pointer, i64, pointer, pointer, i64,
                                                      ctypes.c_float]
    lib.comlrl_attention_softmax_backward.restype = None
    lib.comlrl_grad_weight.argtypes = [i64, i64, i64, pointer, i64, pointer, i64, pointer, i64]
    lib.comlrl_grad_weight.restype = ctypes.c_int
    lib.comlrl_decode_step_work_floats.argtypes = [i64] * 9
    lib.comlrl_decode_step_work_floats.restype = i64
    lib.comlrl_decode_step.argtypes = [ctypes.POINTER(_StepPlan), pointer, pointer, i64, pointer]
    lib.comlrl_decode_step.restype = ctypes.c_int
    for family in ("", "_avx2"):
        for name in ("comlrl_own_scores", "comlrl_own_weighted", "comlrl_own_transposed"):
            getattr(lib, name + family).argtypes = [i64, i64, i64, i64, pointer, pointer, pointer]
        getattr(lib, "comlrl_own_scores" + family).restype = ctypes.c_int
        getattr(lib, "comlrl_own_weighted" + family).restype = None
        getattr(lib, "comlrl_own_transposed" + family).restype = None
    _library = lib
    return lib


def runs(tensor: torch.Tensor) -> bool:
    """Whether the kernels can run on `tensor`'s dtype and device here: fp32 on the CPU, one torch
    thread, the library built."""
    return (tensor.device.type == "cpu" and tensor.dtype == torch.float32 and torch.get_num_threads() == 1
            and library() is not None)


def attention(query_key: torch.Tensor, heads: int, group_size: int, prefix_keys: torch.Tensor,
              prefix_values: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, steps: int,
              bias: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode step's attention (see `lean.StackedLeanDecoder.step`), (rows, heads * head_dim):
    `query_key` (rows, heads + more heads, head_dim), rotated, queries first (rows may be strided,
    as in a QKV projection's output; the heads after the queries are not read); the prompts' keys
    (prompts, kv, head_dim, width) and values (prompts, kv, width, head_dim), each shared by
    `group_size` consecutive rows; every row's generated keys (rows, kv, head_dim, max_new) and
    values (rows, kv, max_new, head_dim), of which the first `steps` columns are used; `bias`
    (rows, 1, 1, >= width + steps), additive. All fp32 and contiguous. One softmax per row and
    head over the prompt and generated columns, as the torch path computes it, to float rounding."""
    rows, _, dim = query_key.shape
    kv_heads = prefix_keys.shape[1]
    width, max_new = prefix_keys.shape[-1], keys.shape[-1]
    for tensor in (query_key[0], prefix_keys, prefix_values, keys, values, bias):
        if not tensor.is_contiguous() or tensor.dtype != torch.float32:
            raise ValueError("decode_kernels.attention needs contiguous fp32 tensors")
    out = torch.empty(rows, heads * dim, dtype=torch.float32)
    scratch = torch.empty(library().comlrl_decode_attention_scratch_floats(group_size, heads // kv_heads, width, steps),
                          dtype=torch.float32)
    library().comlrl_decode_attention(
        rows, kv_heads, heads // kv_heads, dim, group_size, query_key.data_ptr(), query_key.stride(0),
        prefix_keys.data_ptr(), prefix_values.data_ptr(), width, keys.data_ptr(), values.data_ptr(), max_new, steps,
        bias.data_ptr(), bias.shape[-1], scale, out.data_ptr(), scratch.data_ptr())
    return out


def rotate_into_cache(qkv: torch.Tensor, rotation: torch.Tensor, heads: int, keys: torch.Tensor,
                      values: torch.Tensor, column: int) -> torch.Tensor:
    """A decode step's rotary embedding and K/V cache write: `qkv` (rows, (heads + 2 kv) * head_dim),
    fp32, query and key heads' rotary pairs adjacent, has its query and key heads rotated in place
    by `rotation` (rows, 1, head_dim / 2) complex64 (`training_ops.rotate_pairs`, to float rounding);
    the rotated keys and the values are written at `column` of `keys` (rows, kv, head_dim, max_new)
    and `values` (rows, kv, max_new, head_dim). Returns `qkv` as (rows, heads + 2 kv, head_dim)."""
    rows, kv_heads, dim, max_new = keys.shape
    rotation = torch.view_as_real(rotation.contiguous())  # a no-op for the rollout's step-major table
    if (qkv.dtype != torch.float32 or qkv.stride(-1) != 1 or qkv.shape != (rows, (heads + 2 * kv_heads) * dim)
            or rotation.dtype != torch.float32 or not rotation.is_contiguous() or rotation.numel() != rows * dim
            or not keys.is_contiguous() or not values.is_contiguous() or not 0 <= column < max_new):
        raise ValueError("decode_kernels.rotate_into_cache: shapes, dtypes or column do not fit the cache")
    library().comlrl_rotate_into_cache(rows, heads, kv_heads, dim, qkv.data_ptr(), qkv.stride(0), rotation.data_ptr(),
                                       keys.data_ptr(), values.data_ptr(), max_new, column)
    return qkv.view(rows, heads + 2 * kv_heads, dim)


def rotate(x: torch.Tensor, rotation: torch.Tensor, conjugate: bool = False) -> Optional[torch.Tensor]:
    """`training_ops.rotate_pairs(x, rotation)` (or by the conjugate rotation) for fp32 x (rows,
    heads, head_dim) whose heads are contiguous within a row (rows may be strided, as slices of a
    QKV output are) and `rotation` (rows, 1, head_dim / 2) complex64: a new contiguous tensor,
    equal to the complex product to float rounding. None where these layouts do not hold."""
    rows, heads, dim = x.shape
    if (x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != dim or rotation.dtype != torch.complex64
            or rotation.shape != (rows, 1, dim // 2)):
        return None
    rotation = torch.view_as_real(rotation.contiguous())
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    library().comlrl_rotate(rows, heads, dim, x.data_ptr(), x.stride(0), rotation.data_ptr(), int(conjugate),
                            out.data_ptr())
    return out


def residual_rms_norm(hidden: torch.Tensor, delta: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """`hidden += delta` in place (no add when `delta` is None), then returns hidden scaled row by row
    to unit root mean square: RMSNorm without its scale, `hidden / sqrt(mean(hidden^2) + eps)` over
    the last dimension. fp32, contiguous, same shape; agrees with `F.rms_norm` to float rounding."""
    if not hidden.is_contiguous() or (delta is not None and (not delta.is_contiguous() or delta.shape != hidden.shape)):
        raise ValueError("decode_kernels.residual_rms_norm needs contiguous tensors of one shape")
    out = torch.empty_like(hidden)
    library().comlrl_residual_rms_norm(hidden.numel() // hidden.shape[-1], hidden.shape[-1], hidden.data_ptr(),
                                       None if delta is None else delta.data_ptr(), eps, out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up` for `gate_up` = [gate | up] on the last dimension (fp32,
    contiguous); agrees with the torch ops to float rounding."""
    if not gate_up.is_contiguous() or gate_up.shape[-1] % 2:
        raise ValueError("decode_kernels.silu_mul needs a contiguous [gate | up] tensor")
    half = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], half)
    library().comlrl_silu_mul(gate_up.numel() // gate_up.shape[-1], half, gate_up.data_ptr(), out.data_ptr())
    return out


def swiglu_backward(gate_up: torch.Tensor, grad_hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(`silu_mul(gate_up)`, bitwise, and the gradient with respect to `gate_up` (fp32, contiguous)
    given the gradient `grad_hidden` of that output: [grad * up * silu'(gate) | grad * silu(gate)]),
    from one pass over gate_up."""
    half = gate_up.shape[-1] // 2
    grad_hidden = grad_hidden.contiguous()
    if not gate_up.is_contiguous() or grad_hidden.shape != (*gate_up.shape[:-1], half) \
            or grad_hidden.dtype != torch.float32:
        raise ValueError("decode_kernels.swiglu_backward needs a contiguous [gate | up] and a gradient of half its width")
    grad_gate_up = torch.empty_like(gate_up)
    hidden = torch.empty_like(grad_hidden)
    library().comlrl_swiglu_backward(gate_up.numel() // gate_up.shape[-1], half, gate_up.data_ptr(), None,
                                     grad_hidden.data_ptr(), grad_gate_up.data_ptr(), hidden.data_ptr())
    return hidden, grad_gate_up


def swiglu_backward_rows(row_addresses: torch.Tensor, owners: Tuple[torch.Tensor, ...],
                         grad_hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """`swiglu_backward` with gate_up's rows read where they lie: row r of gate_up is the
    2 * n floats at the address `row_addresses[r]` (int64, one per row of `grad_hidden` (rows, n)),
    inside one of `owners` (fp32 tensors whose rows are contiguous; checked). For rows that a
    `ProjectionRecord` holds, which a gather would copy first."""
    rows, half = grad_hidden.shape
    grad_hidden = grad_hidden.contiguous()
    if (grad_hidden.dtype != torch.float32 or row_addresses.dtype != torch.int64 or not row_addresses.is_contiguous()
            or row_addresses.shape != (rows,)):
        raise ValueError("decode_kernels.swiglu_backward_rows needs fp32 gradients and one int64 address per row")
    inside = torch.zeros(rows, dtype=torch.bool)
    for owner in owners:
        if owner.dtype == torch.float32 and owner.shape[-1] == 2 * half and owner.stride(-1) == 1:
            start = owner.untyped_storage().data_ptr()
            inside |= (row_addresses >= start) & (row_addresses + 8 * half <= start + owner.untyped_storage().nbytes())
    if not bool(inside.all()):
        raise ValueError("decode_kernels.swiglu_backward_rows: a row address lies outside the tensors that hold gate_up")
    grad_gate_up = grad_hidden.new_empty(rows, 2 * half)
    hidden = torch.empty_like(grad_hidden)
    library().comlrl_swiglu_backward(rows, half, None, row_addresses.data_ptr(), grad_hidden.data_ptr(),
                                     grad_gate_up.data_ptr(), hidden.data_ptr())
    return hidden, grad_gate_up


def _check_rows(rows: torch.Tensor, index: torch.Tensor, count: int, name: str) -> None:
    if rows.dtype != torch.float32 or rows.dim() != 2 or rows.stride(1) != 1 or rows.stride(0) != rows.shape[1]:
        raise ValueError(f"decode_kernels.{name}: rows must be contiguous fp32 (n, d)")
    if index.dtype != torch.int64 or not index.is_contiguous() or index.shape != (count,):
        raise ValueError(f"decode_kernels.{name}: the index must be contiguous int64 ({count},)")
    if count and not 0 <= int(index.min()) <= int(index.max()) < rows.shape[0]:
        raise ValueError(f"decode_kernels.{name}: an index outside the {rows.shape[0]} rows")


def gather_rows(rows: torch.Tensor, index: torch.Tensor, check: bool = True) -> torch.Tensor:
    """`rows.index_select(0, index)` for contiguous fp32 rows (n, d) and an int64 index: a memcpy
    per row. `check=False` skips the index bounds check (the caller built the index for `rows`)."""
    out = torch.empty(index.shape[0], rows.shape[1], dtype=torch.float32)
    if check:
        _check_rows(rows, index, index.shape[0], "gather_rows")
    library().comlrl_gather_rows(index.shape[0], rows.shape[1], rows.data_ptr(), index.data_ptr(), out.data_ptr())
    return out


def scatter_rows(source: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, check: bool = True) -> None:
    """`rows.index_copy_(0, index, source)`: row index[i] of `rows` (n, d, contiguous fp32) = row i
    of `source` (len(index), d, contiguous fp32)."""
    if check:
        _check_rows(rows, index, source.shape[0], "scatter_rows")
        if source.dtype != torch.float32 or not source.is_contiguous() or source.shape[1:] != rows.shape[1:]:
            raise ValueError("decode_kernels.scatter_rows: the source must be contiguous fp32 rows like `rows`'")
    library().comlrl_scatter_rows(index.shape[0], rows.shape[1], source.data_ptr(), index.data_ptr(), rows.data_ptr())


def _norm_shape(x: torch.Tensor, weight: torch.Tensor) -> Tuple[int, int]:
    rows, dim = x.shape
    if not x.is_contiguous() or weight.shape != (dim,) or not weight.is_contiguous():
        raise ValueError("decode_kernels.rms_norm needs a contiguous (rows, dim) input and a (dim,) weight")
    return rows, dim


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             rstd: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with its scale over the last dimension of 2-D fp32 `x`: (weight * x * rstd, rstd)
    with rstd (rows, 1) = 1 / sqrt(mean(x^2) + eps); given `rstd` (from an earlier call), it is
    reused, so the output is the earlier call's, bitwise."""
    rows, dim = _norm_shape(x, weight)
    out = torch.empty_like(x)
    given = rstd is not None
    rstd = rstd if given else x.new_empty(rows, 1)
    library().comlrl_rms_norm(rows, dim, x.data_ptr(), weight.data_ptr(), eps, rstd.data_ptr() if given else None,
                              None if given else rstd.data_ptr(), out.data_ptr())
    return out, rstd


def rms_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm`'s rstd (rows, 1) alone, bitwise the same, without writing the normalized rows."""
    rows, dim = _norm_shape(x, weight)
    rstd = x.new_empty(rows, 1)
    library().comlrl_rms_norm(rows, dim, x.data_ptr(), weight.data_ptr(), eps, None, rstd.data_ptr(), None)
    return rstd


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                      weight_needs_grad: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(grad of x, grad of weight or None) of `rms_norm(x, weight, eps)` given the gradient of its
    output and the forward's `rstd`; fp32, 2-D."""
    grad = grad.contiguous()
    if grad.shape != x.shape or grad.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("decode_kernels.rms_norm_backward needs fp32 gradients shaped like the contiguous input")
    grad_x = torch.empty_like(x)
    grad_weight = torch.zeros_like(weight) if weight_needs_grad else None
    library().comlrl_rms_norm_backward(x.shape[0], x.shape[1], grad.data_ptr(), x.data_ptr(), rstd.data_ptr(),
                                       weight.data_ptr(), grad_x.data_ptr(),
                                       None if grad_weight is None else grad_weight.data_ptr())
    return grad_x, grad_weight


def draw_tokens(logits: torch.Tensor, uniforms: torch.Tensor, top_k: int, temperature: float,
                top_p: float) -> torch.Tensor:
    """One token per row of `logits` (rows, vocab), fp32, as `rollout.draw_tokens` draws it with
    top-k (0 < top_k < vocab): temperature, the top k (ties: lower token id first), top-p over
    them, then the token where the row's uniform (`uniforms` (rows,), fp32) falls in their
    cumulative distribution. A row's draw depends only on its logits and uniform."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or uniforms.shape != (rows,) or uniforms.dtype != torch.float32 or not 0 < top_k < vocab:
        raise ValueError("decode_kernels.draw_tokens needs fp32 logits rows, one fp32 uniform per row and 0 < top_k < vocab")
    uniforms = uniforms.contiguous()
    out = torch.empty(rows, dtype=torch.long)
    values, cdf, ids = torch.empty(top_k), torch.empty(top_k), torch.empty(top_k, dtype=torch.long)
    library().comlrl_draw_tokens(rows, vocab, logits.data_ptr(), logits.stride(0), uniforms.data_ptr(), top_k,
                                 temperature, top_p, out.data_ptr(), values.data_ptr(), ids.data_ptr(), cdf.data_ptr())
    return out


def _score_blocks(prefix: torch.Tensor, own: Optional[torch.Tensor], blocks: int) -> Tuple[int, int, int]:
    """(rows, width, own_len) of `attention_softmax`'s score layout, checked: `prefix` holds `blocks`
    blocks of (rows, width) and `own`, if given, the same rows of own_len, both contiguous fp32."""
    width = prefix.shape[-1]
    rows = prefix.numel() // (blocks * width) if blocks and width else 0
    own_len = 0 if own is None else own.shape[-1]
    for t in (prefix,) if own is None else (prefix, own):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("decode_kernels.attention_softmax needs contiguous fp32 scores")
    if prefix.numel() != blocks * rows * width or (own is not None and own.numel() != blocks * rows * own_len):
        raise ValueError("decode_kernels.attention_softmax: the score blocks do not have the same rows")
    return rows, width, own_len


def attention_softmax(prefix: torch.Tensor, own: Optional[torch.Tensor], blocks: int, period: int,
                      bias: torch.Tensor, scale: float) -> None:
    """The training attention's softmax, in place (see `comlrl_attention_softmax`): `prefix` holds
    `blocks` blocks of (rows, width) raw scores against a prompt's keys, `own` (or None) the same
    rows' (rows, own_len) scores against their own tokens, causal by position (row % `period`).
    `bias` (bias_blocks, period or 1, width) is additive over the prefix columns: block b reads
    bias block b // (blocks // bias_blocks), row position (or its one row). Scores become
    `scale * score + bias`, then probabilities over both parts."""
    rows, width, own_len = _score_blocks(prefix, own, blocks)
    bias_blocks, bias_rows = bias.shape[0], bias.shape[1]
    if (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape[-1] != width or bias.dim() != 3
            or bias_rows not in (1, period) or blocks % bias_blocks):
        raise ValueError("decode_kernels.attention_softmax needs a contiguous fp32 bias (bias_blocks, period or 1, width)")
    library().comlrl_attention_softmax(blocks, rows, period, prefix.data_ptr(), width, bias.data_ptr(),
                                       blocks // bias_blocks, bias_rows * width, 0 if bias_rows == 1 else width,
                                       None if own is None else own.data_ptr(), own_len, scale)


def attention_softmax_backward(prefix_probs: torch.Tensor, prefix_grad: torch.Tensor, own_probs: Optional[torch.Tensor],
                               own_grad: Optional[torch.Tensor], blocks: int, period: int, scale: float) -> None:
    """The backward pass of `attention_softmax`, in place: the gradients with respect to the
    probabilities (`prefix_grad`, `own_grad`, laid out as the probabilities) become those with
    respect to the raw scores."""
    rows, width, own_len = _score_blocks(prefix_probs, own_probs, blocks)
    if _score_blocks(prefix_grad, own_grad, blocks) != (rows, width, own_len):
        raise ValueError("decode_kernels.attention_softmax_backward: gradients and probabilities differ in layout")
    library().comlrl_attention_softmax_backward(blocks, rows, period, prefix_probs.data_ptr(), prefix_grad.data_ptr(),
                                                width, None if own_probs is None else own_probs.data_ptr(),
                                                None if own_grad is None else own_grad.data_ptr(), own_len, scale)


def grad_weight(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`grad^T x` (out, in): a linear layer's weight gradient from its output gradient `grad`
    (tokens, out) and input `x` (tokens, in), fp32, rows strided as they come (the last dimension
    contiguous), with no transposed copies; each element sums over the tokens in order, one fused
    multiply-add at a time. AVX-512 CPUs only (`AVX512_PANELS`)."""
    tokens, n = grad.shape
    m = x.shape[1]
    if not AVX512_PANELS:
        raise ValueError("decode_kernels.grad_weight needs a CPU on which PyTorch runs AVX-512 code")
    if (x.shape[0] != tokens or grad.dtype != torch.float32 or x.dtype != torch.float32
            or (n > 1 and grad.stride(1) != 1) or (m > 1 and x.stride(1) != 1)):
        raise ValueError("decode_kernels.grad_weight needs fp32 (tokens, out) and (tokens, in) with contiguous rows")
    out = torch.empty(n, m, dtype=torch.float32)
    if library().comlrl_grad_weight(tokens, n, m, grad.data_ptr(), grad.stride(0), x.data_ptr(), x.stride(0),
                                    out.data_ptr(), m):
        raise MemoryError(f"decode_kernels: no memory for the panels of a {tokens}-token weight gradient")
    return out


def _own_blocks(a: torch.Tensor, b: torch.Tensor, period: int) -> Tuple[int, int]:
    """(blocks, rows) of the own-token products' operands, checked: contiguous fp32 (blocks,
    rows, ...) and (blocks, ...), rows a whole number of periods."""
    blocks, rows = a.shape[0], a.shape[1]
    for t in (a, b):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 3 or t.shape[0] != blocks:
            raise ValueError("decode_kernels: the own-token products need contiguous fp32 (blocks, rows, n) tensors")
    if period < 1 or rows % period:
        raise ValueError(f"decode_kernels: {rows} rows are not whole periods of {period} positions")
    return blocks, rows


def _own_entry(name: str, avx512: Optional[bool]):
    """The C function `name` of the AVX-512 family (`avx512`, default: where the CPU has it) or of
    the AVX2 one; both give the same results bit for bit."""
    if avx512 is None:
        avx512 = AVX512_PANELS
    if avx512 and not AVX512_PANELS:
        raise ValueError("the AVX-512 kernels need a CPU on which PyTorch runs AVX-512 code")
    return getattr(library(), name if avx512 else name + "_avx2")


_OWN_PADDING = 5  # the AVX2 `own_transposed` reads six keys' weights at once, the AVX-512 one four


def _padded_empty(*shape: int) -> torch.Tensor:
    """An fp32 tensor of `shape` whose storage runs `_OWN_PADDING` floats past its end."""
    count = math.prod(shape)
    return torch.empty(count + _OWN_PADDING, dtype=torch.float32)[:count].view(shape)


def own_scores(queries: torch.Tensor, keys: torch.Tensor, avx512: Optional[bool] = None) -> torch.Tensor:
    """The training attention's scores of each row's queries against its own tokens, causal:
    `queries` (blocks, heads * period, dim), a KV head's query heads one after another, `keys`
    (blocks, period, dim); returns (blocks, heads * period, period) whose row at position p holds
    the products with keys 0 .. p (columns further on, up to the end of their 16-column block, hold
    values to be ignored; the rest is not written). `attention_softmax` reads only the seen ones."""
    period, dim = keys.shape[1], queries.shape[2]
    blocks, rows = _own_blocks(queries, keys, period)
    if keys.shape[2] != dim:
        raise ValueError("decode_kernels.own_scores: queries and keys differ in head size")
    out = _padded_empty(blocks, rows, period)  # `own_transposed` reads it 4 or 6 columns at a time
    if _own_entry("comlrl_own_scores", avx512)(blocks, rows, period, dim, queries.data_ptr(), keys.data_ptr(),
                                               out.data_ptr()):
        raise MemoryError("decode_kernels: no memory for the keys' transposed copy")
    return out


def own_weighted(weights: torch.Tensor, values: torch.Tensor, avx512: Optional[bool] = None) -> torch.Tensor:
    """`torch.bmm(weights, values)` for `weights` (blocks, heads * period, period) that are 0 past
    each row's position (probabilities or score gradients after `attention_softmax`) and
    `values` (blocks, period, dim): each row sums over the keys it sees only."""
    period, dim = weights.shape[2], values.shape[2]
    blocks, rows = _own_blocks(weights, values, period)
    if values.shape[1] != period:
        raise ValueError("decode_kernels.own_weighted: the weights' columns are not the values' rows")
    out = torch.empty(blocks, rows, dim, dtype=torch.float32)
    _own_entry("comlrl_own_weighted", avx512)(blocks, rows, period, dim, weights.data_ptr(), values.data_ptr(),
                                              out.data_ptr())
    return out


def own_transposed(weights: torch.Tensor, x: torch.Tensor, avx512: Optional[bool] = None) -> torch.Tensor:
    """`torch.bmm(weights.transpose(1, 2), x)` for `weights` as in `own_weighted` and `x` (blocks,
    heads * period, dim): key j sums over the rows at positions >= j only."""
    period, dim = weights.shape[2], x.shape[2]
    blocks, rows = _own_blocks(weights, x, period)
    if x.shape[1] != rows:
        raise ValueError("decode_kernels.own_transposed: the weights and x differ in rows")
    readable = weights.untyped_storage().nbytes() // 4 - weights.storage_offset()
    if readable < weights.numel() + _OWN_PADDING:  # the kernels read 4 or 6 keys' weights at once
        weights = _padded_empty(*weights.shape).copy_(weights)
    out = torch.empty(blocks, period, dim, dtype=torch.float32)
    _own_entry("comlrl_own_transposed", avx512)(blocks, rows, period, dim, weights.data_ptr(), x.data_ptr(),
                                                out.data_ptr())
    return out


def _aligned_empty(floats: int) -> torch.Tensor:
    """A float32 buffer of `floats` elements whose first element is 64-byte aligned."""
    raw = torch.empty(floats + _ALIGN_FLOATS, dtype=torch.float32)
    offset = (-raw.data_ptr() // 4) % _ALIGN_FLOATS
    return raw[offset: offset + floats]


def row_addresses(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The address of every row of `parts` stacked (each part (..., columns), its columns
    contiguous, any view of a parameter): int64, one per row, in the order `torch.cat` of the
    parts flattened to 2-D would have them. A pure function of each part's address, element size,
    shape and strides, so it is cached on them: the same parameters are packed every sampling
    call, and making the table anew took ~10 torch calls per part."""
    return _row_addresses(tuple((p.data_ptr(), p.element_size(), tuple(p.shape[:-1]), p.stride()[:-1]) for p in parts))


@functools.lru_cache(maxsize=512)
def _row_addresses(layouts: tuple) -> torch.Tensor:
    addresses = []
    for address, element_size, lead, strides in layouts:
        offsets = torch.zeros(lead, dtype=torch.int64)
        for d, (size, stride) in enumerate(zip(lead, strides)):
            offsets += (torch.arange(size, dtype=torch.int64) * stride).view([-1 if i == d else 1 for i in range(len(lead))])
        addresses.append(address + element_size * offsets.reshape(-1))
    return torch.cat(addresses)


class PanelWeights:
    """Several agents' weights of one projection (each (out, in), fp32, on the CPU), packed once for
    the kernel: `(A, rows, in) -> (A, rows, out)`, agent a's rows through agent a's weight, plus its
    bias. An agent's weight may come as its parts instead (a sequence of tensors whose rows, stacked,
    make the weight: views of the parameters, read in place), with `norms[a]` (in,) folded into its
    columns (`training_ops.joined_weight`'s weight, without making it). `width`: the panel width,
    which picks the kernels (`PANEL_WIDTHS`, default `PANEL_WIDTH`); `avx512`: whether 16-wide panels
    run the AVX-512 kernels (default: where the CPU has them; tests set it to run the AVX2 ones there
    too). Every choice gives the same results, bit for bit."""

    def __init__(self, weights: Sequence[Union[torch.Tensor, Sequence[torch.Tensor]]],
                 biases: Optional[List[torch.Tensor]] = None, width: Optional[int] = None,
                 avx512: Optional[bool] = None, norms: Optional[Sequence[Optional[torch.Tensor]]] = None):
        lib = library()
        assert lib is not None, "PanelWeights needs the kernel: check decode_kernels.runs() first"
        self.width = width or PANEL_WIDTH
        if self.width not in PANEL_WIDTHS:
            raise ValueError(f"panel width {self.width}: the kernels take {PANEL_WIDTHS}")
        if avx512 and not AVX512_PANELS:
            raise ValueError("the AVX-512 kernels need a CPU on which PyTorch runs AVX-512 code")
        self.avx512 = self.width == 16 and (AVX512_PANELS if avx512 is None else avx512)
        self.count = len(weights)
        agent_parts = [[w] if isinstance(w, torch.Tensor) else list(w) for w in weights]
        agent_parts = [[p if p.stride(-1) == 1 else p.contiguous() for p in parts] for parts in agent_parts]
        self.in_features = agent_parts[0][0].shape[-1]
        self.out_features = sum(p.numel() // self.in_features for p in agent_parts[0])
        panels = -(-self.out_features // self.width)
        self._agent_floats = panels * self.in_features * self.width
        self.packed = _aligned_empty(self.count * self._agent_floats)
        for a, parts in enumerate(agent_parts):
            rows = row_addresses(parts)
            if rows.numel() != self.out_features or any(p.shape[-1] != self.in_features for p in parts):
                raise ValueError(f"PanelWeights: agent {a}'s weight is not ({self.out_features}, {self.in_features})")
            norm = None if norms is None else norms[a]
            if norm is not None:
                norm = norm.reshape(-1).to(torch.float32).contiguous()
            lib.comlrl_pack_panels(rows.data_ptr(), None if norm is None else norm.data_ptr(), self.out_features,
                                   self.in_features, self.packed.data_ptr() + 4 * a * self._agent_floats, self.width)
        self.bias = None
        if biases is not None:
            self.bias = torch.zeros(self.count, panels * self.width, dtype=torch.float32)
            self.bias[:, : self.out_features] = torch.stack([b.reshape(-1) for b in biases])
        # The call's fixed arguments, once: a decode step makes ~17 of these calls, and looking
        # them up per call cost about as much as the ctypes call itself.
        self._gemm = lib.comlrl_panel_gemm
        self._weight_args = (self.packed.data_ptr(), self._agent_floats,
                             None if self.bias is None else self.bias.data_ptr(),
                             0 if self.bias is None else self.bias.stride(0))

    def __call__(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`x` (A, rows, in) through each agent's weight, into `out` (A, rows, out_features, fp32,
        contiguous) when given, else into a new tensor."""
        agents, rows, width = x.shape
        if agents != self.count or width != self.in_features or x.dtype != torch.float32:
            raise ValueError(f"PanelWeights for {self.count} agents x {self.in_features} inputs (float32) "
                             f"got {tuple(x.shape)} {x.dtype}")
        if not x.is_contiguous():  # the decode step's inputs are
            x = x.contiguous()
        n = self.out_features
        if out is None:
            out = torch.empty(agents, rows, n, dtype=torch.float32)
        elif out.shape != (agents, rows, n) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"PanelWeights output must be a contiguous float32 {(agents, rows, n)} tensor, "
                             f"got {tuple(out.shape)} {out.dtype}")
        if self._gemm(agents, rows, n, width, x.data_ptr(), rows * width, width, *self._weight_args,
                      out.data_ptr(), rows * n, n, self.width, int(self.avx512)):
            raise MemoryError(f"decode_kernels: no memory for a {rows} x {width} copy of the projection's input")
        return out


class _StepProjection(ctypes.Structure):
    _fields_ = [("packed", ctypes.c_void_p), ("packed_stride", ctypes.c_int64), ("bias", ctypes.c_void_p),
                ("bias_stride", ctypes.c_int64), ("width", ctypes.c_int64), ("avx512", ctypes.c_int64),
                ("record", ctypes.c_void_p)]


class _StepLayer(ctypes.Structure):
    _fields_ = [("qkv", _StepProjection), ("o", _StepProjection), ("gate_up", _StepProjection),
                ("down", _StepProjection), ("prefix_keys", ctypes.c_void_p), ("prefix_values", ctypes.c_void_p),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("next_eps", ctypes.c_float)]


class _StepPlan(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("agents", "rows", "layers", "hidden", "heads", "kv_heads", "dim",
                                                     "intermediate", "vocab", "group_size", "width", "max_new")] + [
        ("embed", ctypes.c_void_p), ("head", _StepProjection), ("attention_bias", ctypes.c_void_p),
        ("bias_stride", ctypes.c_int64), ("scale", ctypes.c_float), ("first_eps", ctypes.c_float),
        ("work", ctypes.c_void_p), ("layer", ctypes.POINTER(_StepLayer))]


def _step_projection(panels: PanelWeights, record: Optional[torch.Tensor]) -> _StepProjection:
    return _StepProjection(panels.packed.data_ptr(), panels._agent_floats,
                           None if panels.bias is None else panels.bias.data_ptr(),
                           0 if panels.bias is None else panels.bias.stride(0), panels.width, int(panels.avx512),
                           None if record is None else record.data_ptr())


class DecodeStepPlan:
    """Everything a whole decode step reads and writes, as addresses for one C call per step
    (`comlrl_decode_step`; see `lean.StackedLeanDecoder.step`, whose per-kernel calls it makes in the
    same order, so every result is the same bit for bit). Built once per sampling call; it holds the
    tensors it points into, so they live as long as it does.

    `layers`: per layer, its (qkv, o, gate_up, down) `PanelWeights`, prompt keys and values, cache
    keys and values, the norms' eps after the attention and after the MLP, and its recorded
    (max_new, agents, rows, n) step outputs per projection (None: not recorded)."""

    def __init__(self, *, agents: int, rows: int, heads: int, kv_heads: int, head_dim: int, group_size: int,
                 embed: torch.Tensor, head: PanelWeights, attention_bias: torch.Tensor, first_eps: float,
                 layers: List[tuple]):
        prefix_keys = layers[0][1]
        keys = layers[0][3]
        width, max_new = prefix_keys.shape[-1], keys.shape[-1]
        hidden, intermediate = embed.shape[1], layers[0][0][2].out_features // 2
        tensors = [embed, attention_bias]
        for projections, *cache, _, _, records in layers:
            tensors += cache + [r for r in records if r is not None]
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            raise ValueError("DecodeStepPlan needs contiguous fp32 embeddings, caches, bias and records")
        if attention_bias.numel() != agents * rows * attention_bias.shape[-1] or attention_bias.shape[-1] < width + max_new:
            raise ValueError("DecodeStepPlan: the attention bias must be (rows, 1, 1, >= prompt width + max_new)")
        lib = library()
        self._held = tensors + [p.packed for ps, *_ in layers for p in ps] + [head.packed]
        self.work = _aligned_empty(lib.comlrl_decode_step_work_floats(
            agents, rows, hidden, heads, kv_heads, head_dim, intermediate, width, max_new))
        self._layers = (_StepLayer * len(layers))(*[
            _StepLayer(*[_step_projection(p, r) for p, r in zip(projections, records)],
                       pk.data_ptr(), pv.data_ptr(), k.data_ptr(), v.data_ptr(), eps, next_eps)
            for projections, pk, pv, k, v, eps, next_eps, records in layers])
        self.vocab = head.out_features
        self.total = agents * rows
        self.max_new = max_new
        self._plan = _StepPlan(agents, rows, len(layers), hidden, heads, kv_heads, head_dim, intermediate,
                               self.vocab, group_size, width, max_new, embed.data_ptr(), _step_projection(head, None),
                               attention_bias.data_ptr(), attention_bias.shape[-1], head_dim ** -0.5, first_eps,
                               self.work.data_ptr(), self._layers)
        self._plan_pointer = ctypes.byref(self._plan)
        self._step = lib.comlrl_decode_step

    def __call__(self, tokens: torch.Tensor, rotation: torch.Tensor, step: int,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (agents * rows, vocab) for `tokens` (agents * rows,) int64 at decode step `step`
        (`rotation`: its (rows, 1, head_dim / 2) complex64 slice of the rotary table), written into
        `out` (contiguous fp32, agents * rows * vocab elements; a record's slice) when given."""
        if tokens.shape != (self.total,) or tokens.dtype != torch.int64 or not 0 <= step < self.max_new:
            raise ValueError(f"DecodeStepPlan: want {self.total} int64 tokens and a step below {self.max_new}")
        tokens = tokens.contiguous()
        rotation = torch.view_as_real(rotation.contiguous())
        if rotation.dtype != torch.float32 or rotation.numel() != self.total * self._plan.dim:
            raise ValueError("DecodeStepPlan: want a complex64 rotation of head_dim / 2 pairs per row")
        if out is None:
            logits = torch.empty(self.total, self.vocab, dtype=torch.float32)
        elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != self.total * self.vocab:
            raise ValueError(f"DecodeStepPlan: `out` must be contiguous fp32 with {self.total} x {self.vocab} elements")
        else:
            logits = out.view(self.total, self.vocab)
        if self._step(self._plan_pointer, tokens.data_ptr(), rotation.data_ptr(), step, logits.data_ptr()):
            raise ValueError(f"decode step: a token id outside the vocabulary (0..{self.vocab - 1}): {tokens.tolist()}")
        return logits


if __name__ == "__main__":  # `make install` builds the library ahead of the first run
    built = build() if _cpu_supports_kernel() else None
    print(f"decode_kernels: {built or 'not built (no AVX2/FMA CPU or no C compiler); decode uses torch.bmm'}")
