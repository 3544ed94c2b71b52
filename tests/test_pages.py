"""Freed memory kept for reuse (`pages.keep_freed_memory`): a training step's tensors land on the
last step's pages instead of fresh ones, and the setting stays out of the way where asked to."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# Allocates, writes and frees a 16 MB block three times (through libc, so that nothing else moves
# the heap in between) and prints the page faults of the second and third. By default glibc maps
# such a block on its own and unmaps it when freed, and raising its threshold to the freed size
# still maps the next block of that size, whose pages fault in again; kept, it is reused.
_PROBE = textwrap.dedent("""
    import ctypes, resource
    from comlrl.models import pages
    kept = pages.keep_freed_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    def block():
        size = 16 * 1024 * 1024
        address = libc.malloc(size)
        libc.memset(address, 1, size)
        libc.free(address)
    block()
    before = faults()
    block(); block()
    print(kept, faults() - before)
""")


def _probe(**env: str):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "COMLRL_KEEP_FREED_MEMORY"}
    environment.update(env)
    done = subprocess.run([sys.executable, "-c", _PROBE], env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kept, faults = done.stdout.split()
    return kept == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    kept, faults = _probe()
    if not kept:
        pytest.skip("this C library is not glibc")
    _, default_faults = _probe(COMLRL_KEEP_FREED_MEMORY="0")
    assert default_faults > 3500  # the second block's 16 MB on fresh pages (4 KiB each)
    assert faults < 100


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
@pytest.mark.parametrize("env", [dict(COMLRL_KEEP_FREED_MEMORY="0"), dict(MALLOC_TRIM_THRESHOLD_="1000000"),
                                 dict(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000000")],
                         ids=["opted-out", "user-malloc-env", "user-tunables"])
def test_malloc_is_left_alone_when_asked_or_already_tuned(env):
    kept, _ = _probe(**env)
    assert not kept
