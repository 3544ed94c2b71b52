"""Stop signals, requeues and cluster launches of the experiment repo (CPU, tiny model, subprocesses).

* SIGTERM / SIGUSR1 / SIGINT (Ctrl-C: to the whole process group) sent to `experiments/main.py`
  mid-epoch: the run finishes its update, writes a checkpoint holding every logged row and exits
  with 75 (PREEMPTED_EXIT_CODE). After SIGTERM, `make resume RUN=<dir>` ends with weights
  torch.equal to an uninterrupted run, the same metrics.jsonl (every env_step once, identical
  values) and every step once in the W&B offline segments.
* A `hydra/launcher=submitit_local` sweep of 2 jobs (with `resume=true`, as on a cluster): job 0
  gets submitit's preemption/time-out signal (SIGUSR2); submitit requeues it, the requeued job
  re-runs in the same job dir and continues from its latest checkpoint. Both jobs end identical to
  the uninterrupted run.
* A requeued SLURM job (SLURM_RESTART_COUNT > 0) resumes in its own dir even without `resume=true`.
* A 2-rank torchrun run stopped by SIGTERM (torchrun forwards it to the ranks, which checkpoint
  together) and resumed by 1 process: completes with a note and a warning about the changed rank
  count, every env_step once, weights within float reduction noise of the one-process run
  (sampling is keyed per prompt, so the rank count does not change the samples).
* `make resume` of a run that stopped while writing final/ writes it again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from comlrl.run import RunDirError, latest_checkpoint, prepare_run_dir, read_segments
from comlrl.trainers.reinforce import PREEMPTED_EXIT_CODE

REPO = Path(__file__).resolve().parents[1]
MAIN = REPO / "experiments" / "main.py"
# 4 epochs x 2 updates x (2 prompts x K=2 joint actions) = env_steps 4, 8, ..., 32; a row and a step
# checkpoint after every update. Small enough that one process trains in ~3 s on a shared CPU.
CONFIG = ["experiment=smoke", "trainer.max_new_tokens=8", "trainer.num_generations=2",
          "trainer.num_train_epochs=4", "checkpoint.steps=1"]
STEPS = [4 * (i + 1) for i in range(8)]

pytestmark = pytest.mark.slow


def environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
            "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}


def run(cmd, timeout=300, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=environment(), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def make(*args, **kwargs) -> subprocess.CompletedProcess:
    # `-o install`: the suite already runs inside the installed environment; PY: this interpreter.
    return run(["make", "--no-print-directory", "-o", "install", *args, f"PY={sys.executable}"], **kwargs)


def rows(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def final_weights(run_dir: Path) -> list:
    return [load_file(str(run_dir / "final" / f"agent_{i}" / "model.safetensors")) for i in range(2)]


def assert_same_weights(got_dir: Path, want_dir: Path) -> None:
    for i, (got, want) in enumerate(zip(final_weights(got_dir), final_weights(want_dir))):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"{got_dir}: agent {i} {name} differs from the uninterrupted run"


def has_checkpoint(run_dir: Path) -> bool:
    ckpts = run_dir / "checkpoints"
    return ckpts.is_dir() and any(p.name.startswith(("step-", "checkpoint-")) for p in ckpts.iterdir())


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the process ended ({proc.returncode}) before {what}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def checkpoint_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def latest_env_step(run_dir: Path) -> int:
    """env_step of the latest checkpoint of a run that is still training (it may prune as we read)."""
    for _ in range(50):
        try:
            return checkpoint_state(latest_checkpoint(run_dir))["progress"]["env_step"]
        except (OSError, TypeError, ValueError):
            time.sleep(0.02)
    raise AssertionError(f"no readable checkpoint in {run_dir}")


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> Path:
    """The reference: CONFIG in one go (tiny_model_dir builds the model before any parallel job)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run([sys.executable, MAIN, *CONFIG, f"hydra.run.dir={run_dir}"])
    assert [r["env_step"] for r in rows(run_dir)] == STEPS
    return run_dir


# ------------------------------------------------------------------------------------------------
# Stop signals through the Hydra entry point
# ------------------------------------------------------------------------------------------------

def stop_with(sig: signal.Signals, run_dir: Path, log_path: Path, extra=(), group: bool = False) -> int:
    """Start CONFIG in `run_dir`, send `sig` mid-epoch (to its process group, as a terminal's Ctrl-C
    does, with `group`), return the exit status; checks the stop point."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(MAIN), *CONFIG, *extra, f"hydra.run.dir={run_dir}"],
                                cwd=REPO, env=environment(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            # Mid-epoch: the first update has logged its row; the signal lands in it or in the next one.
            wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and rows(run_dir), proc, "the first metrics row")
            if group:  # W&B's service process gets it too
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
            returncode = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
    output = log_path.read_text()
    assert returncode == PREEMPTED_EXIT_CODE, output[-4000:]
    assert f"{sig.name} received" in output and f"make resume RUN={run_dir}" in output

    # The stop wrote a checkpoint at the stop point: it holds every row logged so far, and the run
    # stopped early (no final weights yet).
    latest = latest_checkpoint(run_dir)
    assert latest is not None, "no checkpoint written at the stop"
    progress = checkpoint_state(latest)["progress"]
    logged = [r["env_step"] for r in rows(run_dir)]
    assert logged == STEPS[:len(logged)] and progress["last_logged_step"] == progress["env_step"] == logged[-1]
    assert progress["updates_done"] < len(STEPS) and not (run_dir / "final").exists()
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    return returncode


def test_sigterm_checkpoints_exits_75_and_resumes_exactly(uninterrupted, tmp_path):
    """What a scheduler sends, with the default logger (W&B offline)."""
    run_dir = tmp_path / "run"
    stop_with(signal.SIGTERM, run_dir, tmp_path / "first.log", ["logger=wandb"])
    latest = latest_checkpoint(run_dir)

    resumed = make("resume", f"RUN={run_dir}")
    assert f"from {latest.name}" in resumed.stdout
    assert_same_weights(run_dir, uninterrupted)
    assert rows(run_dir) == rows(uninterrupted)  # every env_step once, identical values
    segments = read_segments(run_dir)
    assert [s["resume"] for s in segments] == [False, True] and segments[1]["resumed_from"] == latest.name

    from comlrl.wandb_offline import find_offline_runs

    offline = find_offline_runs(run_dir / "wandb")  # two segments, one run id, every step once
    assert len(offline) == 2 and len({seg.run_id for seg in offline}) == 1
    assert sorted(row["_step"] for seg in offline for row in seg.history) == STEPS

    # Stopped after the last checkpoint, while writing final/: `make resume` writes it again.
    (run_dir / "final" / "agent_1" / "model.safetensors").unlink()
    rewritten = make("resume", f"RUN={run_dir}")
    assert "final/ is incomplete" in rewritten.stdout
    assert_same_weights(run_dir, uninterrupted)
    assert rows(run_dir) == rows(uninterrupted) and len(find_offline_runs(run_dir / "wandb")) == 2


def test_sigusr1_stops_the_same_way(tmp_path):
    """Same stop as SIGTERM (checkpoint holding every logged row, exit 75); resuming from it is the
    SIGTERM test's business."""
    stop_with(signal.SIGUSR1, tmp_path / "run", tmp_path / "first.log")


def test_ctrl_c_stops_the_same_way_with_wandb(tmp_path):
    """Ctrl-C reaches the whole foreground process group, W&B's service included: the run still
    checkpoints, exits 75 and leaves a complete offline segment holding every logged row."""
    run_dir = tmp_path / "run"
    stop_with(signal.SIGINT, run_dir, tmp_path / "first.log", ["logger=wandb"], group=True)
    from comlrl.wandb_offline import find_offline_runs

    offline = find_offline_runs(run_dir / "wandb")
    assert [row["_step"] for seg in offline for row in seg.history] == [r["env_step"] for r in rows(run_dir)]


# ------------------------------------------------------------------------------------------------
# Sweeps with submitit (local executor): two jobs, one preempted and requeued by submitit
# ------------------------------------------------------------------------------------------------

def test_submitit_local_sweep_requeued_job_continues_from_its_checkpoint(uninterrupted, tmp_path):
    # `${uid:}` in the sweep dir: the requeued job must resolve it to the same dir, not a new one.
    command = [sys.executable, str(MAIN), "-m", *CONFIG, "name=a,b", "resume=true",
               "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=60",
               f"hydra.sweep.dir={tmp_path}/sweep_${{uid:}}"]
    log_path = tmp_path / "sweep.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=environment(), stdout=log, stderr=subprocess.STDOUT)
        try:
            job0 = lambda: next(iter(tmp_path.glob("sweep_*/0")), None)  # noqa: E731
            wait_for(lambda: job0() is not None and has_checkpoint(job0()) and read_segments(job0()), proc,
                     "job 0's first checkpoint", timeout=240)
            at_signal = latest_env_step(job0())
            # What SLURM sends `signal_delay_s` before the time limit (and at a preemption where the
            # cluster signals it): submitit's own handler checkpoints the launcher call and requeues.
            os.kill(read_segments(job0())[0]["pid"], signal.SIGUSR2)
            returncode = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    output = log_path.read_text()
    assert returncode == 0, output[-4000:]

    sweeps = list(tmp_path.glob("sweep_*"))
    assert len(sweeps) == 1, f"the requeued job wrote elsewhere: {sweeps}"
    for job in ("0", "1"):
        job_dir = sweeps[0] / job
        assert (job_dir / "checkpoints" / "checkpoint-4").is_dir(), job
        assert_same_weights(job_dir, uninterrupted)
        assert rows(job_dir) == rows(uninterrupted), f"job {job}: metrics.jsonl differs"
    requeued = read_segments(sweeps[0] / "0")
    assert len(requeued) == 2 and requeued[0]["resumed_from"] is None, requeued
    assert requeued[1]["resume"] and requeued[1]["resumed_from"] is not None, requeued
    assert requeued[1]["env_step"] >= at_signal, "the requeued job went back before its latest checkpoint"
    assert "Caught signal SIGUSR2" in "".join(p.read_text() for p in sweeps[0].glob(".submitit/*/*_log.*"))
    assert len(read_segments(sweeps[0] / "1")) == 1


def test_slurm_requeue_resumes_without_resume_flag(tmp_path, monkeypatch):
    """A job SLURM requeued (preemption with PreemptMode=REQUEUE, or submitit after a time-out) starts
    over with the overrides it was submitted with; it must continue in its own dir, not refuse it."""
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    cfg = OmegaConf.create({"resume": False, "seed": 0, "trainer": {"temperature": 0.6, "allow_resume_drift": []},
                            "checkpoint": {"interval": 1}})
    assert prepare_run_dir(cfg, tmp_path) is None
    with pytest.raises(RunDirError, match="make resume"):
        prepare_run_dir(cfg, tmp_path)  # a plain second start is refused, as before

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert prepare_run_dir(cfg, tmp_path) == "auto"
    assert read_segments(tmp_path)[-1]["resume"] is True and read_segments(tmp_path)[-1]["requeue"] == 1

    drifted = OmegaConf.merge(cfg, {"trainer": {"temperature": 0.9}})
    with pytest.raises(RunDirError, match="trainer.temperature"):
        prepare_run_dir(drifted, tmp_path)  # a requeue still refuses a changed config
    assert prepare_run_dir(cfg, tmp_path / "fresh") == "auto"  # "auto" without checkpoints = fresh start


def test_slurm_launcher_is_wired_for_preemption():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.signal_delay_s >= 60  # time for the update in flight plus a checkpoint write
    assert launcher.max_num_timeout >= 1  # time-outs are requeued (preemptions always are)
    assert launcher.tasks_per_node == 1   # one training process per job (see slurm.yaml)


# ------------------------------------------------------------------------------------------------
# Resume with a different number of ranks
# ------------------------------------------------------------------------------------------------

def test_two_rank_run_stopped_by_sigterm_resumes_with_one_process(uninterrupted, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 str(MAIN), *CONFIG, "trainer.agent_devices=cpu", f"hydra.run.dir={run_dir}"],
                                cwd=REPO, env=environment(), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and rows(run_dir), proc, "the first metrics row")
            proc.send_signal(signal.SIGTERM)  # to torchrun's agent, which forwards it to both ranks
            returncode = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
    output = log_path.read_text()
    # The ranks agree on the stop and checkpoint together; torchrun's agent then reports the signal it
    # got (SignalException, status 1), not the ranks' 75.
    assert returncode != 0 and "Stopped by SIGTERM" in output, output[-4000:]
    latest = latest_checkpoint(run_dir)
    state = checkpoint_state(latest)
    assert state["world_size"] == 2
    assert state["progress"]["env_step"] == rows(run_dir)[-1]["env_step"] and not (run_dir / "final").exists()

    resumed = make("resume", f"RUN={run_dir}")  # NPROC=1
    assert f"{latest.name} was written by 2 rank(s) and is resumed by 1" in resumed.stdout  # resume.py's note
    output = resumed.stdout + resumed.stderr + (run_dir / "train.log").read_text()
    assert "written by 2 ranks and is resumed by 1" in output and "re-sharded" in output  # the trainer's warning

    assert [r["env_step"] for r in rows(run_dir)] == STEPS  # every env_step once
    assert checkpoint_state(latest_checkpoint(run_dir))["world_size"] == 1
    # Same samples (keyed per prompt), same global minibatches; only the float reduction order of the
    # 2-rank updates differs from one process. Tolerance as in test_distributed.py.
    from comlrl.models import load_causal_lm

    initial = dict(load_causal_lm(tiny_model_dir).named_parameters())
    for i, (got, want) in enumerate(zip(final_weights(run_dir), final_weights(uninterrupted))):
        moved = max((want[n] - initial[n].detach()).abs().max().item() for n in want if n in initial)
        diff = max((got[n] - want[n]).abs().max().item() for n in want)
        assert moved > 1e-3 and diff <= 1e-5, f"agent {i}: moved {moved}, |2->1 ranks - 1 rank| = {diff}"
    for got, want in zip(rows(run_dir), rows(uninterrupted)):
        assert got["turn_1/reward_mean"] == pytest.approx(want["turn_1/reward_mean"], abs=1e-9)

