"""Fault injection for the fault-tolerance tests: kill the process at a named point.

Set ``COMLRL_KILL_AT=<site>:<n>`` and the process SIGKILLs itself the n-th time it reaches
``<site>`` (1-based), exactly as an OOM killer or a lost node would stop it. Unset, every call is a
dictionary lookup. Sites (see the trainer and checkpoint code): ``generate``, ``reward``,
``backward``, ``optimizer_step``, ``update_end``, ``log_written``, ``checkpoint_files``
(temporary checkpoint dir half written), ``checkpoint_renamed`` (checkpoint in place, older ones
not yet pruned).
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_counts: Counter = Counter()
_target = os.environ.get("COMLRL_KILL_AT", "")
_site, _, _nth = _target.partition(":")
_nth_value = int(_nth) if _nth.isdigit() else 1


def point(site: str) -> None:
    """Die here if COMLRL_KILL_AT names this site and this is its n-th visit."""
    if not _site or site != _site:
        return
    _counts[site] += 1
    if _counts[site] == _nth_value:
        os.kill(os.getpid(), signal.SIGKILL)
