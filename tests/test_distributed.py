"""Data parallelism on CPU with torchrun and gloo (2 processes)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from comlrl.wandb_offline import find_offline_runs

SCRIPTS = Path(__file__).parent / "scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, *args: str, nproc: int = 2, kill_at: str | None = None,
             timeout: int = 600) -> subprocess.CompletedProcess:
    env = os.environ.copy()
    env.pop("COMLRL_KILL_AT", None)
    if kill_at:
        env["COMLRL_KILL_AT"] = kill_at
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", str(SCRIPTS / script), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def weights(path: Path) -> dict:
    return {i: load_file(str(path / f"agent_{i}.safetensors")) for i in range(2)}


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_process_run(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dp")
    result = torchrun("dp_run.py", tiny_model_dir, str(run_dir), "3")
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


def test_two_process_run_one_set_of_checkpoints_one_wandb_run(two_process_run):
    assert sorted(p.name for p in (two_process_run / "checkpoints").glob("checkpoint-*")) == \
        ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    segments = find_offline_runs(two_process_run / "wandb")
    assert len(segments) == 1  # rank 0 alone logs
    assert [row["_step"] for row in segments[0].history] == [8, 16, 24]
    steps = [r["env_step"] for r in rows(two_process_run)]
    assert steps == [8, 16, 24]  # 4 prompts x K=2 per epoch, counted over both ranks


def test_ranks_end_with_identical_weights(two_process_run):
    rank0, rank1 = weights(two_process_run / "final_rank0"), weights(two_process_run / "final_rank1")
    for i in range(2):
        for name in rank0[i]:
            assert torch.equal(rank0[i][name], rank1[i][name]), f"agent {i} {name} differs across ranks"


def test_two_processes_train_like_one(tiny_model_dir, two_process_run, tmp_path):
    """The same run in one process. Samples are drawn from keyed streams, so both see the same
    rollouts; the minibatches are the same global ones. What remains is float rounding: one padded
    forward over all rows vs two half-size forwards whose gradients are summed, and prompts padded
    to each process's own longest (widths are exact on this CPU, `losses.width_buckets`), so the
    attention sums over differently aligned columns. AdamW turns rounding-level gradient
    differences into larger weight differences where a gradient is near zero (its step is the
    ratio of two moments): measured 1.9e-7 with both padded to one width, 1.7e-5 with exact
    widths. Tolerance: weights within 1e-4 (the run moves them by > 10x that), logged rewards
    equal to 1e-9."""
    single = subprocess.run([sys.executable, str(SCRIPTS / "dp_run.py"), tiny_model_dir, str(tmp_path), "3"],
                            capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    from comlrl.models import load_causal_lm

    initial = dict(load_causal_lm(tiny_model_dir).named_parameters())
    one, two = weights(tmp_path / "final_rank0"), weights(two_process_run / "final_rank0")
    for i in range(2):
        moved = max((one[i][n] - initial[n].detach()).abs().max().item() for n in one[i] if n in initial)
        diff = max((one[i][n] - two[i][n]).abs().max().item() for n in one[i])
        assert moved > 1e-3, moved
        assert diff <= 1e-4, f"agent {i}: max |one process - two processes| = {diff}"
    for a, b in zip(rows(tmp_path), rows(two_process_run)):
        assert a["env_step"] == b["env_step"]
        assert a["turn_1/reward_mean"] == pytest.approx(b["turn_1/reward_mean"], abs=1e-9)


def test_killed_two_process_run_resumes_exactly(tiny_model_dir, two_process_run, tmp_path):
    killed = torchrun("dp_run.py", tiny_model_dir, str(tmp_path), "3", kill_at="generate:3")  # epoch 2, mid-update
    assert killed.returncode != 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("checkpoint-*")) == ["checkpoint-1"]
    resumed = torchrun("dp_run.py", tiny_model_dir, str(tmp_path), "3")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    want, got = weights(two_process_run / "final_rank0"), weights(tmp_path / "final_rank0")
    for i in range(2):
        for name in want[i]:
            assert torch.equal(want[i][name], got[i][name]), f"agent {i} {name}"
    assert rows(tmp_path) == rows(two_process_run)


def test_a_failed_save_on_rank_0_stops_every_rank(tiny_model_dir, tmp_path):
    """Rank 0 cannot write checkpoint-2: every rank stops with the reason, and checkpoint-1 stays
    intact. Rank 1 hears of it from rank 0 instead of waiting at the end of the save; torchrun would
    tear it down anyway, but launchers that do not (other nodes, plain srun) would leave it waiting
    until the collective timeout."""
    result = torchrun("dp_save_failure.py", tiny_model_dir, str(tmp_path), timeout=180)
    assert result.returncode != 0
    assert "No space left on device" in result.stderr
    assert "Rank 0 could not write checkpoint" in result.stderr  # rank 1's error names rank 0's failure
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-1"]
