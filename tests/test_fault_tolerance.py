"""Kill -9 anywhere, resume from the latest complete checkpoint: nothing lost, nothing duplicated.

Each case SIGKILLs a run at one named point (``comlrl.faults``), then starts the same command again
(it resumes with ``resume_from_checkpoint="auto"``). The final weights must be bit-identical to an
uninterrupted run, and metrics.jsonl and the W&B offline segments must hold every env_step exactly
once, with the uninterrupted run's values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from comlrl.checkpoint import checkpoint_problem
from comlrl.wandb_offline import find_offline_runs

SCRIPT = Path(__file__).parent / "scripts" / "fault_run.py"
STEPS = [4, 8, 12, 16]  # 2 epochs x 2 updates x (2 prompts x K=2 joint actions)


def run(model_dir: str, run_dir: Path, kill_at: str | None = None) -> int:
    env = os.environ.copy()
    env.pop("COMLRL_KILL_AT", None)
    if kill_at:
        env["COMLRL_KILL_AT"] = kill_at
    started = time.time()
    proc = subprocess.run([sys.executable, str(SCRIPT), model_dir, str(run_dir)], env=env,
                          capture_output=True, text=True, timeout=300)
    if kill_at:
        wait_for_orphaned_wandb(started)
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.returncode


def wait_for_orphaned_wandb(since: float) -> None:
    """The W&B service of a killed process flushes and exits on its own; resuming while it still
    writes would race it (a real restart comes much later)."""
    deadline = time.time() + 30
    while time.time() < deadline:
        alive = [p for p in psutil.process_iter(["cmdline", "create_time"])
                 if p.info["create_time"] and p.info["create_time"] >= since - 1
                 and any(part.endswith("wandb-core") for part in (p.info["cmdline"] or [])[:1])]
        if not alive:
            return
        time.sleep(0.2)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wandb_rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("_") or k == "_step"}
            for seg in find_offline_runs(run_dir / "wandb") for row in seg.history]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run(tiny_model_dir, run_dir)
    return run_dir


KILL_POINTS = [
    "generate:1",            # before any checkpoint exists: restarts from scratch
    "generate:3",            # second update, generation of agent 0
    "generate:6",            # third update, generation of agent 1
    "reward:2",
    "backward:3",            # second update, agent 0, mid backward/step
    "optimizer_step:4",      # second update, after agent 1's step
    "update_end:2",          # between updates, before the checkpoint
    "log_written:3",         # row in metrics.jsonl, not yet in W&B
    "checkpoint_files:2",    # in the middle of writing checkpoint-1
    "checkpoint_renamed:3",  # step-3 in place, step checkpoint pruning not done
    "checkpoint_files:4",    # in the middle of writing the final checkpoint-2
    "generate:8",            # last update
]


@pytest.mark.parametrize("kill_at", KILL_POINTS)
def test_kill_and_resume_is_exact(tiny_model_dir, uninterrupted, tmp_path, kill_at):
    assert run(tiny_model_dir, tmp_path, kill_at) == -9

    # The users' idiom for "latest" still lands on a complete checkpoint after the crash.
    epoch_checkpoints = list((tmp_path / "checkpoints").glob("checkpoint-*"))
    if epoch_checkpoints:
        latest = max(epoch_checkpoints, key=lambda p: int(p.name.rsplit("-", 1)[1]))
        assert checkpoint_problem(latest) is None

    run(tiny_model_dir, tmp_path)

    for i in range(2):
        got = load_file(str(tmp_path / "final" / f"agent_{i}.safetensors"))
        want = load_file(str(uninterrupted / "final" / f"agent_{i}.safetensors"))
        for name in want:
            assert torch.equal(got[name], want[name]), f"{kill_at}: agent {i} {name} differs"

    assert rows(tmp_path) == rows(uninterrupted)
    assert [r["env_step"] for r in rows(tmp_path)] == STEPS
    logged = wandb_rows(tmp_path)
    assert sorted(r["_step"] for r in logged) == STEPS, f"{kill_at}: W&B steps {[r['_step'] for r in logged]}"
    assert sorted(logged, key=lambda r: r["_step"]) == wandb_rows(uninterrupted)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
