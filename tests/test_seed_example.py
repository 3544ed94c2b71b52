"""The user's resume example, unchanged, in separate processes; and bit-exact resume.

Three processes share the work: `first` trains 2 epochs, `resume` continues the same run to 4, and
`straight` trains 4 epochs in one go in another dir. Exact resume means every parameter is
`torch.equal` and every logged value identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from comlrl.utils import read_checkpoint_metadata
from comlrl.wandb_offline import find_offline_runs

SCRIPT = Path(__file__).parent / "scripts" / "seed_example.py"


def run_phase(model_dir: str, run_dir: Path, phase: str, epochs: int) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), model_dir, str(run_dir), phase, str(epochs)],
                            capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    resumed = tmp_path_factory.mktemp("resumed")
    straight = tmp_path_factory.mktemp("straight")
    run_phase(tiny_model_dir, resumed, "first", 2)
    first_segment_checkpoints = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    run_phase(tiny_model_dir, resumed, "resume", 4)
    run_phase(tiny_model_dir, straight, "straight", 4)
    return {"resumed": resumed, "straight": straight, "after_first": first_segment_checkpoints}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_checkpoints_one_to_four(runs):
    assert runs["after_first"] == ["checkpoint-1", "checkpoint-2"]
    names = sorted(p.name for p in (runs["resumed"] / "checkpoints").iterdir())
    assert names == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"]
    meta = read_checkpoint_metadata(runs["resumed"] / "checkpoints" / "checkpoint-4")
    assert set(meta) == {"version", "trainer_class", "sequence", "run_id", "wandb"}
    assert meta["trainer_class"] == "MAGRPOTrainer"
    assert meta["wandb"]["project"] == "comlrl-examples"
    first = read_checkpoint_metadata(runs["resumed"] / "checkpoints" / "checkpoint-1")
    assert first["run_id"] == meta["run_id"] and first["wandb"]["id"] == meta["wandb"]["id"]


def test_wandb_segments_share_one_run_and_steps_follow_on(runs):
    segments = find_offline_runs(runs["resumed"] / "wandb")
    assert len(segments) == 2
    assert segments[0].run_id == segments[1].run_id
    first_steps = [row["_step"] for row in segments[0].history]
    second_steps = [row["_step"] for row in segments[1].history]
    assert first_steps == [8, 16, 24, 32]
    assert second_steps == [40, 48, 56, 64]
    assert min(second_steps) > max(first_steps)
    all_steps = first_steps + second_steps
    assert len(all_steps) == len(set(all_steps)) and all_steps[-1] == 64


def test_resumed_weights_bit_identical_to_straight_run(runs):
    for i in range(2):
        resumed = load_file(str(runs["resumed"] / "final_resume" / f"agent_{i}.safetensors"))
        straight = load_file(str(runs["straight"] / "final_straight" / f"agent_{i}.safetensors"))
        assert resumed.keys() == straight.keys()
        for name in resumed:
            assert torch.equal(resumed[name], straight[name]), f"agent {i} parameter {name} differs"
    # and training really changed them (the comparison would be vacuous otherwise)
    first = load_file(str(runs["resumed"] / "final_first" / "agent_0.safetensors"))
    final = load_file(str(runs["resumed"] / "final_resume" / "agent_0.safetensors"))
    assert any(not torch.equal(first[n], final[n]) for n in first)


def test_logged_values_identical_at_every_step(runs):
    resumed = read_jsonl(runs["resumed"] / "metrics.jsonl")
    straight = read_jsonl(runs["straight"] / "metrics.jsonl")
    assert [r["env_step"] for r in resumed] == [8, 16, 24, 32, 40, 48, 56, 64]
    assert resumed == straight
    wandb_resumed = [row for seg in find_offline_runs(runs["resumed"] / "wandb") for row in seg.history]
    wandb_straight = [row for seg in find_offline_runs(runs["straight"] / "wandb") for row in seg.history]
    keys = [k for k in resumed[0] if k != "env_step"]
    assert [[r[k] for k in keys] for r in wandb_resumed] == [[r[k] for k in keys] for r in wandb_straight]
    assert [[r[k] for k in keys] for r in wandb_resumed] == [[r[k] for k in keys] for r in resumed]


def test_every_row_has_the_promised_metrics(runs):
    row = read_jsonl(runs["straight"] / "metrics.jsonl")[0]
    for key in ("turn_1/reward_mean", "turn_1/expected_return", "agent_0/loss", "agent_1/loss",
                "agent_0/completion_length", "agent_1/completion_length", "agent_0/learning_rate"):
        assert key in row
