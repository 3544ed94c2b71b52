"""`make bench` is not a timed test; this only checks that the harnesses run (1-epoch smoke of ours, and
one short round of the real-shape throughput mode)."""

from __future__ import annotations

import json
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
    # The host's speed is measured before the round and reported with the table.
    probe = output.split("host probe ", 1)[1].split(" GFLOP/s", 1)[0]
    assert float(probe) > 0
    assert "Host speed probe before each round" in output


def test_real_shape_throughput_mode_runs(tmp_path):
    """The real-shape mode (Qwen2.5-0.5B's config, random init, one layer to keep it short) times
    both precisions and reports positive token rates."""
    out = tmp_path / "throughput.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "throughput.py"), "--device", "cpu", "--layers", "1",
         "--repeats", "1", "--prompts", "1", "--num-generations", "2", "--prompt-tokens", "8",
         "--max-new-tokens", "4", "--json-out", str(out)],
        cwd=REPO, capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["shape"] == "qwen2.5-0.5b" and summary["layers"] == 1
    assert summary["parameters"] > 136_000_000  # the real vocabulary and width, not a tiny model
    assert set(summary["results"]) == {"no", "bf16"}
    for figures in summary["results"].values():
        assert figures["generation_tokens_per_s"] > 0 and figures["update_tokens_per_s"] > 0
