"""Fresh memory and its page faults: a sampling call's KV cache (and the step buffers of the
projection records, `lean._StackedRecord`) on transparent huge pages, and freed memory kept for
reuse (`keep_freed_memory`).

The first write to each 4 KiB page of fresh memory costs a page fault, measured at 1.7-2 us on the
benchmark hosts, and the decode cache is fresh memory on every sampling call (8 MB at the L
benchmark's shape, ~2,000 faults, and a zeroing pass over it). An `Arena` is one anonymous mapping
that starts on a 2 MiB boundary and is advised for transparent huge pages (`madvise(MADV_HUGEPAGE)`,
which Linux honours in its default `madvise` mode): the kernel hands it over zeroed, one fault per
2 MiB. L benchmark, Zen 4 EPYC: setting up the cache 0.040 -> 0.003 s over the run and the prefill,
which first writes it, ~0.34 -> ~0.31 s; peak RSS unchanged. The mapping is unmapped when the last
tensor carved from it is freed.

Tried and not kept: the decode's packed weights (19.4 MB per call) in an arena too. Their page
faults went from ~1,600 to ~130 per call, but packing took as long (it is bound by the transposing
copy, not the faults) and the run's peak RSS rose 13-14 MB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import os

import torch

log = logging.getLogger(__name__)

#: A huge page: arenas from this size up start on this boundary; smaller ones are torch allocations.
HUGE_PAGE_BYTES = 2 * 1024 * 1024

#: The alignment of every tensor an arena hands out, in bytes (a cache line).
ALIGN = 64


class Arena:
    """`nbytes` of zeroed CPU memory, handed out as consecutive tensors (`take`). From
    `HUGE_PAGE_BYTES` up it is an anonymous mapping of its own, huge-page aligned and advised;
    below that, or where the platform has no `MADV_HUGEPAGE`, one `torch.zeros` buffer."""

    def __init__(self, nbytes: int):
        self.capacity = nbytes
        self._used = 0
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if nbytes < HUGE_PAGE_BYTES or advice is None:
            self._buffer = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
            return
        # One huge page more than asked, so that the part used can start on a huge-page boundary
        # (the untouched rest costs address space only).
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mapping.madvise(advice)
        except OSError:  # huge pages switched off: 4 KiB pages, zeroed all the same
            pass
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE_BYTES
        self._buffer = whole[start:start + nbytes]

    def take(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The next zeroed, contiguous tensor of `shape`, its first element `ALIGN`-byte aligned.
        Ask for each tensor's bytes plus `ALIGN` in the arena's size."""
        start = self._used + (-(self._buffer.data_ptr() + self._used) % ALIGN)
        end = start + math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end > self.capacity:
            raise ValueError(f"pages.Arena: {end - self._used} more bytes asked, {self.capacity - self._used} left")
        self._used = end
        return self._buffer[start:end].view(dtype).view(shape)


#: glibc's mallopt parameters (malloc.h) and the values `keep_freed_memory` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest; blocks past it are mappings of their own
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024
_kept = False


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep memory the process frees, up to `TRIM_THRESHOLD_BYTES` of it, for its
    next allocations, instead of handing it back to the kernel; returns whether it is set.

    A training step allocates and frees the same tensors over and over (activations, gradients,
    each sampling call's packed weights, all of a few hundred KB to 20 MB). By default glibc serves
    blocks past a threshold that starts at 128 KB as mappings of their own and unmaps them when
    freed, and returns the top of its heap once more than twice that threshold is free there, so the
    next step's tensors land on fresh pages again: a page fault and a zeroing pass per 4 KiB. At the
    L benchmark's shape (AVX2 EPYC) that was ~99,000-133,000 faults and 0.31-0.39 s of kernel time
    per run; with these settings ~45,000 and 0.10-0.15 s, peak RSS 2-5 MB higher (632-635 ->
    637-639 MB; S-small and S-medium unchanged).

    Once per process, on Linux with glibc, unless `COMLRL_KEEP_FREED_MEMORY=0` or the user tuned
    malloc already (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `GLIBC_TUNABLES`, or a
    preloaded allocator such as jemalloc or tcmalloc, which have their own policies). The trainer
    calls it for runs with an agent on the CPU."""
    global _kept
    if _kept:
        return True
    if os.environ.get("COMLRL_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) or any(
            "malloc" in os.environ.get(k, "") for k in ("GLIBC_TUNABLES", "LD_PRELOAD")):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: other C libraries' mallopt take other parameters
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The threshold first: setting either one also stops glibc from moving them as it goes.
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        log.debug("pages: glibc refused the malloc settings; freed memory goes back to the kernel as before")
        return False
    _kept = True
    return True
