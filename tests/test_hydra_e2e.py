"""End-to-end runs of the experiment repo in subprocesses, on the tiny model (CPU, offline).

* experiments/main.py trains 1 epoch into a given run dir; `make resume RUN=<dir> EPOCHS=2`
  continues it in place: checkpoint-2 in the same dir, every env_step once in metrics.jsonl, both
  W&B offline segments under one run id.
* Disallowed overrides on resume are refused with a message, and nothing in the run changes.
* A finished run is left alone; a missing run dir is a clear error.
* A 2-job multirun with the joblib launcher gives two run dirs with checkpoints.
* `make train NPROC=2` (torchrun, gloo on CPU): both ranks share one run dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAIN = REPO / "experiments" / "main.py"
# Small and quick: 1 epoch of 2 updates, 16 new tokens, no progress bar.
SMALL = ["experiment=smoke", "trainer.max_new_tokens=16"]

pytestmark = pytest.mark.slow


def run(cmd, timeout=240, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def make(*args, **kwargs):
    # `-o install`: the suite already runs inside the installed environment; PY: this interpreter.
    return run(["make", "--no-print-directory", "-o", "install", *args, f"PY={sys.executable}"], **kwargs)


def snapshot(directory: Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def metrics_steps(run_dir: Path) -> list:
    return [json.loads(line)["env_step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """1 epoch with W&B offline, then `make resume ... EPOCHS=2` in the same dir."""
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    first = run([sys.executable, MAIN, *SMALL, "logger=wandb", f"hydra.run.dir={run_dir}"])
    assert f"Run dir: {run_dir}" in first.stdout
    after_first = {
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir()),
        "steps": metrics_steps(run_dir),
        "hydra_overrides": (run_dir / ".hydra" / "overrides.yaml").read_text(),
    }
    second = make("resume", f"RUN={run_dir}", "EPOCHS=2")
    return run_dir, after_first, first, second


def test_first_segment_writes_a_complete_run_dir(resumed_run):
    run_dir, after_first, _, _ = resumed_run
    assert after_first["checkpoints"] == ["checkpoint-1"]
    assert after_first["steps"] == [8, 16]
    for name in ("run_config.yaml", "segments.jsonl", "train.log", "metrics.jsonl", "final", "wandb", ".hydra"):
        assert (run_dir / name).exists(), name
    assert (run_dir / "final" / "agent_0" / "config.json").is_file()
    assert (run_dir / "final" / "agent_1" / "config.json").is_file()


def test_resume_continues_in_the_same_dir(resumed_run):
    run_dir, after_first, _, second = resumed_run
    assert "Resuming" in second.stdout and "checkpoint-1" in second.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    steps = metrics_steps(run_dir)
    assert steps == [8, 16, 24, 32], "every env_step exactly once, in order"
    # Hydra's record of the first launch survives; the resume keeps its own.
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == after_first["hydra_overrides"]
    assert len(list((run_dir / ".hydra").glob("resume-*/config.yaml"))) == 1
    segments = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()]
    assert [s["resume"] for s in segments] == [False, True]
    assert segments[1]["resumed_from"] == "checkpoint-1" and segments[1]["env_step"] == 16
    # The new target is saved, so a later plain `make resume` knows the run is done.
    assert "num_train_epochs: 2" in (run_dir / "run_config.yaml").read_text()
    assert "comlrl.experiments.main" in (run_dir / "train.log").read_text()


def test_both_wandb_segments_carry_one_run_id(resumed_run):
    from comlrl.utils import read_checkpoint_metadata
    from comlrl.wandb_offline import find_offline_runs

    run_dir, _, _, _ = resumed_run
    segments = find_offline_runs(run_dir / "wandb")
    assert len(segments) == 2
    ids = {segment.run_id for segment in segments}
    assert len(ids) == 1
    assert read_checkpoint_metadata(run_dir / "checkpoints" / "checkpoint-2")["wandb"]["id"] in ids
    steps = [step for segment in segments for step in segment.steps]
    assert steps == sorted(set(steps)), f"W&B steps logged twice: {steps}"


def test_finished_run_is_left_alone(resumed_run):
    run_dir, _, _, _ = resumed_run
    before = snapshot(run_dir)
    done = make("resume", f"RUN={run_dir}")
    assert "finished" in done.stdout and "2 of 2 epochs" in done.stdout
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("override, key", [
    ("trainer.temperature=0.9", "trainer.temperature"),
    ("model.size=medium", "model.size"),
])
def test_resume_refuses_non_run_shape_overrides(resumed_run, override, key):
    run_dir, _, _, _ = resumed_run
    before = snapshot(run_dir)
    refused = make("resume", f"RUN={run_dir}", "EPOCHS=3", f"ARGS={override}", check=False)
    assert refused.returncode != 0
    assert f"Resume refuses the override '{override}'" in refused.stderr
    assert f"`{key}`" in refused.stderr and "trainer.num_train_epochs" in refused.stderr
    assert snapshot(run_dir) == before, "a refused resume must not write anything"


def test_main_refuses_drift_when_resumed_directly(resumed_run):
    """Bypassing make resume: main.py compares the composed config with run_config.yaml."""
    run_dir, _, _, _ = resumed_run
    checkpoints = snapshot(run_dir / "checkpoints")
    refused = run([sys.executable, MAIN, f"--config-path={run_dir}", "--config-name=run_config",
                   f"hydra.run.dir={run_dir}", "hydra.output_subdir=null", "resume=true",
                   "trainer.num_train_epochs=3", "trainer.top_p=0.9"], check=False)
    assert refused.returncode != 0
    assert "trainer.top_p" in refused.stderr and "Nothing was written" in refused.stderr
    assert snapshot(run_dir / "checkpoints") == checkpoints
    assert "num_train_epochs: 2" in (run_dir / "run_config.yaml").read_text()


def test_fresh_run_refuses_an_existing_run_dir(resumed_run):
    run_dir, _, _, _ = resumed_run
    before = snapshot(run_dir / "checkpoints")
    refused = run([sys.executable, MAIN, *SMALL, f"hydra.run.dir={run_dir}", "hydra.output_subdir=null"], check=False)
    assert refused.returncode != 0 and "make resume" in refused.stderr
    assert snapshot(run_dir / "checkpoints") == before


def test_resume_errors_on_a_missing_run(tmp_path):
    missing = make("resume", f"RUN={tmp_path / 'nope'}", check=False)
    assert missing.returncode != 0 and "does not exist" in missing.stderr
    (tmp_path / "empty").mkdir()
    empty = make("resume", f"RUN={tmp_path / 'empty'}", check=False)
    assert empty.returncode != 0 and "no run_config.yaml" in empty.stderr


def test_joblib_multirun_gives_one_run_dir_per_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    run([sys.executable, MAIN, "-m", *SMALL, "trainer.num_generations=2,4", "hydra/launcher=joblib",
         "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep_dir}"], timeout=300)
    for job, k in ((0, 2), (1, 4)):
        job_dir = sweep_dir / str(job)
        assert (job_dir / "checkpoints" / "checkpoint-1").is_dir()
        assert (job_dir / "final" / "agent_1").is_dir()
        assert f"num_generations: {k}" in (job_dir / "run_config.yaml").read_text()
        assert metrics_steps(job_dir) == [2 * k, 4 * k]  # aligned: K joint actions per prompt


def test_torchrun_ranks_share_one_run_dir(tmp_path):
    # The default run dir name (${run_stamp:}) under a tmp root, so both ranks must agree on it.
    make("train", "NPROC=2", f"ARGS={' '.join(SMALL)} name=dp trainer.agent_devices=cpu "
                             f"hydra.run.dir={tmp_path}/\\$${{run_stamp:}}", timeout=300)
    run_dirs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    run_dir = run_dirs[0]
    assert (run_dir / "checkpoints" / "checkpoint-1").is_dir() and (run_dir / "final" / "agent_0").is_dir()
    assert metrics_steps(run_dir) == [8, 16]
    assert len(run_dir.joinpath("segments.jsonl").read_text().splitlines()) == 1  # rank 0 only
