"""The experiment presets of conf/experiment/ (resume_demo, three_agents, multi_turn_feedback,
heterogeneous) and the options they use (reward=length_ladder, data=story_prompts_eval,
transition=reward_feedback|partner_revision).

* Every preset composes with Hydra's compose API to the settings its file promises.
* Every preset runs end to end through experiments/main.py in a subprocess, at a smoke size
  (1 epoch, K=2, 6 new tokens, logger=none), into a tmp run dir: checkpoints, final agents and the
  metrics.jsonl rows and keys that preset is about (agent_2/ for three agents, turn_2/ and eval/ for
  multi-turn, per-agent model sizes for heterogeneous, `make resume ... EPOCHS=2` for resume_demo).
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

import comlrl.run  # noqa: F401  registers the ${uid:} / ${run_stamp:} resolvers the run dir uses
from comlrl.data import STORY_EVAL_PROMPTS, STORY_PROMPTS
from comlrl.rewards import length_ladder_reward, length_ratio_reward
from comlrl.rollout import RewardCaller

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
MAIN = REPO / "experiments" / "main.py"
PRESETS = ["resume_demo", "three_agents", "multi_turn_feedback", "heterogeneous"]
# The smoke size every preset is run at here: 1 epoch of 2 updates (2 prompts each).
SMOKE = ["trainer.num_train_epochs=1", "trainer.max_new_tokens=6", "trainer.num_generations=2",
         "logger=none", "trainer.show_progress=false"]


@pytest.fixture(autouse=True)
def _clean_hydra():
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def compose_cfg(overrides=()):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose("config", overrides=list(overrides))


def partial_of(fn) -> tuple:
    assert isinstance(fn, functools.partial)
    return fn.func, dict(fn.keywords)


# ------------------------------------------------------------------------------------------------
# Composition
# ------------------------------------------------------------------------------------------------

def test_every_preset_is_present():
    assert set(PRESETS) <= {p.stem for p in (CONF / "experiment").glob("*.yaml")}
    for name in PRESETS:
        assert (CONF / "experiment" / f"{name}.yaml").read_text().startswith("# @package _global_\n")


def test_resume_demo_is_the_seed_example_on_the_tiny_model():
    cfg = compose_cfg(["experiment=resume_demo"])
    t = cfg.trainer
    assert (cfg.name, cfg.model.num_agents, t.num_agents) == ("resume_demo", 2, 2)
    assert (t.num_turns, t.num_generations, t.max_new_tokens, t.logging_steps, t.num_train_epochs) == (1, 4, 64, 1, 2)
    assert cfg.model.path._target_ == "comlrl.models.tiny_model_path"
    assert instantiate(cfg.data.train)["prompt"] == list(STORY_PROMPTS)
    assert partial_of(instantiate(cfg.reward.func)) == (length_ratio_reward, {"low": 2.0, "high": 3.0})
    assert cfg.checkpoint.interval == 1 and cfg.logger.mode == "offline"
    assert "make resume RUN=" in (CONF / "experiment" / "resume_demo.yaml").read_text()


def test_three_agents_uses_cross_mode_and_a_three_argument_reward():
    cfg = compose_cfg(["experiment=three_agents"])
    assert cfg.model.num_agents == cfg.trainer.num_agents == 3
    assert cfg.trainer.joint_mode == "cross" and cfg.trainer.num_generations ** 3 <= 64
    reward = instantiate(cfg.reward.func)
    assert partial_of(reward)[0] is length_ladder_reward
    # The trainer's dispatcher takes it as an N-agent function.
    caller = RewardCaller(reward, 3)
    assert caller(["p", "p"], [["ab", "ab"], ["abcd", "a"], ["abcdefgh", "a"]], [{}, {}])[0] == 1.0
    instantiate(cfg.trainer)


def test_multi_turn_feedback_feeds_the_runs_reward_to_the_transition():
    cfg = compose_cfg(["experiment=multi_turn_feedback"])
    t = cfg.trainer
    assert (t.num_turns, t.discount) == (2, 0.9)
    transition = instantiate(cfg.transition)
    assert callable(transition) and "length_ratio_reward" in transition.__qualname__
    assert partial_of(transition.reward_func) == partial_of(instantiate(cfg.reward.func))
    prompts = transition(prompt="Q:", agent_completions=["ab", "abcde"], num_agents=2)
    assert prompts[1] == "Q:\n\nYour previous answer:\nabcde\n\nPrevious joint score: 1.00. Improve it."
    # Another reward for the run is another reward for the feedback.
    switched = instantiate(compose_cfg(["experiment=multi_turn_feedback", "reward.func.low=1.0"]).transition)
    assert partial_of(switched.reward_func)[1] == {"low": 1.0, "high": 3.0}
    # ... and the preset's eval set is wired.
    assert instantiate(cfg.data.eval)["prompt"] == list(STORY_EVAL_PROMPTS)


def test_heterogeneous_agents_have_two_sizes():
    cfg = compose_cfg(["experiment=heterogeneous"])
    assert cfg.model.agent is None and cfg.model.num_agents == 2
    assert [spec.name_or_path.size for spec in cfg.model.agents] == ["small", "medium"]


def test_transition_options_compose_and_are_off_by_default():
    assert compose_cfg().get("transition") is None  # single-turn runs get no transition
    revise = instantiate(compose_cfg(["transition=partner_revision"]).transition)
    assert revise(prompt="Q", agent_completions=["a", "b"], num_agents=2)[0].endswith("Revise your answer:")
    feedback = compose_cfg(["transition=reward_feedback", "reward=length_ladder", "model.num_agents=3"])
    transition = instantiate(feedback.transition)
    assert transition(prompt="Q", agent_completions=["ab", "abcd", "abcdefgh"], num_agents=3)[2].endswith(
        "Previous joint score: 1.00. Improve it.")


def test_story_prompts_eval_holds_out_its_eval_prompts():
    cfg = compose_cfg(["data=story_prompts_eval"])
    train, held_out = instantiate(cfg.data.train), instantiate(cfg.data.eval)
    assert train["prompt"] == list(STORY_PROMPTS) and len(held_out) == 2
    assert not set(held_out["prompt"]) & set(train["prompt"])


# ------------------------------------------------------------------------------------------------
# length_ladder_reward
# ------------------------------------------------------------------------------------------------

def test_length_ladder_reward_scores_every_neighbouring_pair():
    assert length_ladder_reward(["ab"], ["abcd"], ["abcdefgh"]) == [1.0]
    # pair 1->2 in the band, pair 2->3 ratio 1.0 (0.5 below low=1.5): mean of 1 and exp(-0.5)
    assert length_ladder_reward(["ab"], ["abcd"], ["abcd"]) == [(1.0 + math.exp(-0.5)) / 2]
    assert length_ladder_reward([""], ["a"], ["ab"], low=1.0, high=2.0) == [1.0]  # empty first: / max(len, 1)
    c1, c2 = ["ab", "abc", ""], ["abcde", "a", "abcdefghij"]
    assert length_ladder_reward(c1, c2, low=2.0, high=3.0) == length_ratio_reward(c1, c2)


@pytest.mark.parametrize("args, kwargs, message", [
    ((["a"],), {}, "at least 2 agents"),
    ((["a"], ["a", "b"], ["a"]), {}, "equal lengths"),
    ((["a"], ["a"]), {"low": 3.0, "high": 2.0}, "low <= high"),
])
def test_length_ladder_reward_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        length_ladder_reward(*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# End to end: every preset through experiments/main.py, smoke-sized
# ------------------------------------------------------------------------------------------------

def run(cmd, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def train_preset(name: str, run_dir: Path, *extra: str) -> list:
    proc = run([sys.executable, MAIN, f"experiment={name}", *SMOKE, *extra, f"hydra.run.dir={run_dir}"])
    assert f"Run dir: {run_dir}" in proc.stdout
    assert (run_dir / "checkpoints" / "checkpoint-1").is_dir()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def final_agents(run_dir: Path) -> list:
    return sorted(p.name for p in (run_dir / "final").iterdir() if p.name.startswith("agent_"))


@pytest.mark.slow
def test_resume_demo_runs_and_resumes_to_more_epochs(tmp_path):
    run_dir = tmp_path / "resume_demo"
    rows = train_preset("resume_demo", run_dir)
    assert [r["env_step"] for r in rows] == [4, 8]  # aligned: K=2 joint actions x 2 prompts per update
    # The preset's own recipe: `make resume RUN=... EPOCHS=N` continues in the same dir.
    run(["make", "--no-print-directory", "-o", "install", "resume", f"RUN={run_dir}", "EPOCHS=2", f"PY={sys.executable}"])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["env_step"] for r in rows] == [4, 8, 12, 16]
    assert final_agents(run_dir) == ["agent_0", "agent_1"]


@pytest.mark.slow
def test_three_agents_runs_in_cross_mode(tmp_path):
    run_dir = tmp_path / "three_agents"
    rows = train_preset("three_agents", run_dir)
    assert [r["env_step"] for r in rows] == [16, 32]  # cross: K^3 = 8 joint actions x 2 prompts per update
    for row in rows:
        for i in range(3):
            assert math.isfinite(row[f"agent_{i}/loss"]), row
        assert 0.0 < row["turn_1/reward_mean"] <= 1.0
    assert "agent_3/loss" not in rows[0]
    assert final_agents(run_dir) == ["agent_0", "agent_1", "agent_2"]


@pytest.mark.slow
def test_multi_turn_feedback_runs_two_turns_with_feedback_prompts(tmp_path):
    run_dir = tmp_path / "multi_turn_feedback"
    rows = train_preset("multi_turn_feedback", run_dir, "trainer.log_completions=1")
    # turn 1: 2 prompts x K=2 joint actions; turn 2: each of those 4 spawns a node with K=2 -> 8
    assert [r["env_step"] for r in rows] == [12, 24]
    for row in rows:
        assert {"turn_1/reward_mean", "turn_2/reward_mean", "turn_1/expected_return"} <= set(row)
    assert {"eval/turn_1/reward_mean", "eval/turn_2/reward_mean"} <= set(rows[0])  # eval at position 0
    samples = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines() if line]
    turn_2 = [s for s in samples if s["turn"] == 2]
    assert turn_2 and all("Previous joint score:" in s["prompt"] for s in turn_2)
    assert all("Previous joint score:" not in s["prompt"] for s in samples if s["turn"] == 1)


@pytest.mark.slow
def test_heterogeneous_runs_two_model_sizes(tmp_path):
    run_dir = tmp_path / "heterogeneous"
    rows = train_preset("heterogeneous", run_dir)
    assert [r["env_step"] for r in rows] == [4, 8]
    assert {"agent_0/loss", "agent_1/loss"} <= set(rows[-1])
    sizes = [json.loads((run_dir / "final" / agent / "config.json").read_text())["hidden_size"]
             for agent in final_agents(run_dir)]
    assert sizes == [64, 256]
