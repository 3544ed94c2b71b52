"""`make bench` is not a timed test; this only checks that the harness runs (1-epoch smoke, ours)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_benchmark_harness_runs_the_smoke_setting():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), "--smoke"], cwd=REPO,
                            capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "smoke" in output and "ours" in output
    assert "CoMLRL 1.4.3  run" not in output  # the reference venv is only built by a full run
