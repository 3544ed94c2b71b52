"""Multi-turn episodes, cross joint mode and evaluation, end to end on the tiny model (in-process).

Counting used throughout (aligned, K=2, rollout_buffer_size=2): one update scores 2 prompts x 2 joint
actions = 4 at turn 1; each of those 4 joint actions spawns a child node answered with 2 joint actions,
so turn 2 scores 8; env_step grows by 12 per update.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset

from comlrl.data import STORY_PROMPTS, story_prompts
from comlrl.models import load_causal_lm, load_tokenizer
from comlrl.rewards import length_ratio_reward
from comlrl.rollout import JOINT_MODES, joint_action_indices
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.transitions import REVISE_INSTRUCTION, make_reward_feedback_transition, revise_with_partner_feedback

TWO_PROMPTS = Dataset.from_dict({"prompt": list(STORY_PROMPTS[:2])})


@pytest.fixture
def build(tiny_model_dir):
    """A trainer with fresh models: 2 turns, discount 0.5, K=2, 8 new tokens, a log row per update."""

    def make(num_agents=2, reward=length_ratio_reward, transition=revise_with_partner_feedback, dataset=None,
             eval_dataset=None, metrics_path=None, **config):
        settings = dict(num_turns=2, discount=0.5, num_train_epochs=1, num_generations=2, max_new_tokens=8,
                        logging_steps=1, rollout_buffer_size=2, show_progress=False)
        settings.update(config)
        return MAGRPOTrainer(
            agents=[load_causal_lm(tiny_model_dir) for _ in range(num_agents)],
            tokenizer=load_tokenizer(tiny_model_dir),
            reward_func=reward,
            train_dataset=dataset if dataset is not None else story_prompts(),
            eval_dataset=eval_dataset,
            external_transition=transition,
            args=MAGRPOConfig(**settings),
            metrics_path=str(metrics_path) if metrics_path else None,
        )

    return make


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def assert_same_weights(a: MAGRPOTrainer, b: MAGRPOTrainer) -> None:
    assert len(a.agents) == len(b.agents)
    for i, (x, y) in enumerate(zip(a.agents, b.agents)):
        px, py = dict(x.named_parameters()), dict(y.named_parameters())
        assert px.keys() == py.keys()
        for name in px:
            assert torch.equal(px[name], py[name]), f"agent {i} parameter {name} differs"


def scramble_global_rng() -> None:
    """Stand-in for a new process: a resumed run must take every RNG state from its checkpoint."""
    random.seed(12345)
    np.random.seed(12345)
    torch.manual_seed(12345)


def assert_trained(trainer: MAGRPOTrainer, model_dir: str) -> None:
    """Training moved every agent away from its initial weights (else an equality check is vacuous)."""
    initial = dict(load_causal_lm(model_dir).named_parameters())
    for i, agent in enumerate(trainer.agents):
        assert any(not torch.equal(p, initial[n]) for n, p in agent.named_parameters()), f"agent {i} never changed"


class Recorder:
    """Wraps a transition and keeps the keyword arguments of every call."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return self.inner(**kwargs)


# ------------------------------------------------------------------------------------- two turns

def test_two_turns_count_env_steps_log_both_turns_and_pass_histories(build, tmp_path):
    scored = []  # (prompts, completions1, completions2) per reward call

    def reward(prompts, completions1, completions2):
        scored.append((list(prompts), list(completions1), list(completions2)))
        return length_ratio_reward(completions1, completions2)

    transition = Recorder(revise_with_partner_feedback)
    metrics = tmp_path / "metrics.jsonl"
    build(reward=reward, transition=transition, metrics_path=metrics).train()

    logged = rows(metrics)
    assert [r["env_step"] for r in logged] == [12, 24]  # (4 turn-1 + 8 turn-2 joint actions) per update
    for r in logged:
        for key in ("turn_1/reward_mean", "turn_1/expected_return", "turn_2/reward_mean", "turn_2/expected_return"):
            assert key in r and math.isfinite(r[key]), key
        assert not any(k.startswith("turn_3/") for k in r)
        # every turn-1 joint action has one child of 2 joint actions: mean return = r1 + 0.5 * r2
        assert r["turn_1/expected_return"] == pytest.approx(r["turn_1/reward_mean"] + 0.5 * r["turn_2/reward_mean"])
        assert r["turn_2/expected_return"] == pytest.approx(r["turn_2/reward_mean"])

    # one reward call per turn batch: 4 then 8 joint actions, for each of the 2 updates
    assert [len(p) for p, _, _ in scored] == [4, 8, 4, 8]
    first_turn_prompts, second_turn_prompts = scored[0][0], scored[1][0]
    assert first_turn_prompts == [STORY_PROMPTS[0]] * 2 + [STORY_PROMPTS[1]] * 2
    for prompt in second_turn_prompts:
        assert prompt.endswith(REVISE_INSTRUCTION) and prompt.split("\n\n")[0] in STORY_PROMPTS[:2]

    # the transition expands each of the 4 turn-1 joint actions of each update, with 1-long histories
    assert len(transition.calls) == 8
    turn_one_pairs = {(a, b) for _, c1, c2 in (scored[0], scored[2]) for a, b in zip(c1, c2)}
    for call in transition.calls:
        assert call["num_agents"] == 2 and len(call["agent_completions"]) == 2
        assert call["prompt"] in STORY_PROMPTS
        assert len(call["prompt_history_per_agent"]) == 2 and len(call["response_history_per_agent"]) == 2
        for i in range(2):
            assert call["prompt_history_per_agent"][i] == [call["prompt"]]
            assert call["response_history_per_agent"][i] == [call["agent_completions"][i]]
        assert tuple(call["agent_completions"]) in turn_one_pairs


def test_three_turns_histories_grow_and_returns_discount_twice(build, tmp_path):
    transition = Recorder(revise_with_partner_feedback)
    metrics = tmp_path / "metrics.jsonl"
    build(reward=lambda c1, c2: [0.75] * len(c1), transition=transition, dataset=TWO_PROMPTS, num_turns=3,
          metrics_path=metrics).train()

    (row,) = rows(metrics)
    assert row["env_step"] == 4 + 8 + 16
    assert row["turn_3/expected_return"] == pytest.approx(0.75)
    assert row["turn_2/expected_return"] == pytest.approx(0.75 * 1.5)
    assert row["turn_1/expected_return"] == pytest.approx(0.75 * (1 + 0.5 + 0.25))
    # 4 expansions after turn 1 (history of 1 turn), 8 after turn 2 (history of 2 turns)
    lengths = [len(c["response_history_per_agent"][0]) for c in transition.calls]
    assert lengths == [1] * 4 + [2] * 8
    for call in transition.calls[4:]:
        for i in range(2):
            first_prompt, second_prompt = call["prompt_history_per_agent"][i]
            assert first_prompt == call["prompt"] and second_prompt.endswith(REVISE_INSTRUCTION)
            assert call["response_history_per_agent"][i][-1] == call["agent_completions"][i]


@pytest.mark.parametrize("passthrough", [False, True])
def test_next_turn_prompts_go_through_the_formatter_unless_passed_through(build, tmp_path, passthrough, tiny_model_dir):
    seen = []

    def reward(prompts, completions1, completions2):
        seen.append(list(prompts))
        return [0.5] * len(prompts)

    transition = Recorder(revise_with_partner_feedback)
    MAGRPOTrainer(
        agents=[load_causal_lm(tiny_model_dir) for _ in range(2)], tokenizer=load_tokenizer(tiny_model_dir),
        reward_func=reward, train_dataset=TWO_PROMPTS, external_transition=transition,
        formatters=lambda item: "Task: " + item["prompt"],
        args=MAGRPOConfig(num_turns=2, num_train_epochs=1, num_generations=2, max_new_tokens=4, show_progress=False,
                          external_prompt_passthrough=passthrough),
    ).train()
    first_turn, second_turn = seen
    assert all(p.startswith("Task: ") for p in first_turn)
    # the transition gets the row's raw prompt, and sees the formatted one in the history
    assert all(c["prompt"] in STORY_PROMPTS and c["prompt_history_per_agent"][0] == ["Task: " + c["prompt"]]
               for c in transition.calls)
    assert all(p.startswith("Task: ") is (not passthrough) and p.endswith(REVISE_INSTRUCTION) for p in second_turn)


# ------------------------------------------------------------------------------------- resume

def test_two_turn_resume_is_bit_exact(build, tiny_model_dir, tmp_path):
    """2 epochs straight == 1 epoch, stop, fresh trainer resumed to 2 (weights and every logged value,
    evaluation included)."""
    eval_rows = Dataset.from_dict({"prompt": ["Name a color:", "Name a fruit:"]})

    def make(**kw):
        return build(transition=make_reward_feedback_transition(length_ratio_reward), eval_dataset=eval_rows,
                     eval_interval=2, eval_num_samples=2, **kw)

    straight = make(num_train_epochs=2, metrics_path=tmp_path / "straight.jsonl")
    straight.train(checkpoint_dir=str(tmp_path / "straight_ckpt"))

    make(num_train_epochs=1, metrics_path=tmp_path / "resumed.jsonl").train(checkpoint_dir=str(tmp_path / "ckpt"))
    assert [r["env_step"] for r in rows(tmp_path / "resumed.jsonl")] == [12, 24]
    scramble_global_rng()
    resumed = make(num_train_epochs=2, metrics_path=tmp_path / "resumed.jsonl")
    resumed.train(checkpoint_dir=str(tmp_path / "ckpt"), resume_from_checkpoint="auto")

    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert resumed.env_step == straight.env_step == 48
    assert_same_weights(straight, resumed)
    assert_trained(resumed, tiny_model_dir)
    straight_rows, resumed_rows = rows(tmp_path / "straight.jsonl"), rows(tmp_path / "resumed.jsonl")
    assert [r["env_step"] for r in resumed_rows] == [12, 24, 36, 48]
    assert all("eval/turn_2/reward_mean" in r for r in resumed_rows)
    assert resumed_rows == straight_rows


def three_way_reward(completions1, completions2, completions3):
    """Agent 3 should write as much as agents 1 and 2 together."""
    return [math.exp(-abs(len(a) + len(b) - len(c)) / 8) for a, b, c in zip(completions1, completions2, completions3)]


def test_three_agents_cross_mode_two_turns_resume_exactly(build, tiny_model_dir, tmp_path):
    """3 agents, K=2, cross: 2^3 = 8 joint actions per node. One update (2 prompts): turn 1 scores 16,
    each of them spawns a node of 8 at turn 2 (128); 144 env steps per update."""
    calls = []

    def reward(c1, c2, c3):
        calls.append(len(c1))
        return three_way_reward(c1, c2, c3)

    def make(**kw):
        return build(num_agents=3, reward=reward, dataset=TWO_PROMPTS, joint_mode="cross", max_new_tokens=4,
                     train_batch_size=8, **kw)

    straight = make(num_train_epochs=2, metrics_path=tmp_path / "straight.jsonl")
    straight.train()
    assert calls == [16, 128, 16, 128]

    make(num_train_epochs=1, metrics_path=tmp_path / "resumed.jsonl").train(checkpoint_dir=str(tmp_path / "ckpt"))
    scramble_global_rng()
    resumed = make(num_train_epochs=2, metrics_path=tmp_path / "resumed.jsonl")
    resumed.train(checkpoint_dir=str(tmp_path / "ckpt"), resume_from_checkpoint="auto")

    assert len(resumed.agents) == 3
    assert_same_weights(straight, resumed)
    assert_trained(resumed, tiny_model_dir)
    straight_rows, resumed_rows = rows(tmp_path / "straight.jsonl"), rows(tmp_path / "resumed.jsonl")
    assert [r["env_step"] for r in straight_rows] == [144, 288]
    assert "agent_2/loss" in straight_rows[0] and "turn_2/reward_mean" in straight_rows[0]
    assert resumed_rows == straight_rows


# ------------------------------------------------------------------------------------- evaluation

def test_evaluation_leaves_training_untouched_and_logs_eval_metrics(build, tmp_path):
    eval_rows = Dataset.from_dict({"prompt": ["Name a color:", "Name a fruit:", "Name a tree:"]})
    with_eval = build(eval_dataset=eval_rows, eval_interval=1, eval_num_samples=2, metrics_path=tmp_path / "eval.jsonl")
    with_eval.train()
    without = build(metrics_path=tmp_path / "plain.jsonl")
    without.train()

    assert_same_weights(with_eval, without)
    evaluated, plain = rows(tmp_path / "eval.jsonl"), rows(tmp_path / "plain.jsonl")
    assert [r["env_step"] for r in evaluated] == [r["env_step"] for r in plain] == [12, 24]  # eval adds no env steps
    for r in evaluated:
        for key in ("eval/turn_1/reward_mean", "eval/turn_1/expected_return", "eval/turn_2/reward_mean"):
            assert key in r and math.isfinite(r[key]), key
    assert not any(k.startswith("eval/") for r in plain for k in r)
    # the training metrics of both runs are identical value for value
    assert [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in evaluated] == plain


def test_evaluation_does_not_shift_the_training_log_cadence(build, tmp_path):
    """logging_steps=36 with 12 env steps per update: without eval the training rows are at 12 and 48.
    Evaluating before updates 1 and 3 must add eval metrics, not move or drop training rows."""
    eval_rows = Dataset.from_dict({"prompt": ["Name a color:", "Name a fruit:"]})
    common = dict(num_train_epochs=2, logging_steps=36, max_new_tokens=4)
    build(eval_dataset=eval_rows, eval_interval=4, eval_num_samples=2, metrics_path=tmp_path / "eval.jsonl",
          **common).train()
    build(metrics_path=tmp_path / "plain.jsonl", **common).train()

    plain, evaluated = rows(tmp_path / "plain.jsonl"), rows(tmp_path / "eval.jsonl")
    assert [r["env_step"] for r in plain] == [12, 48]
    assert sum(any(k.startswith("eval/") for k in r) for r in evaluated) == 2  # both evaluations are logged
    training = [{k: v for k, v in r.items() if not k.startswith("eval/")}
                for r in evaluated if "turn_1/reward_mean" in r]
    assert training == plain


# ------------------------------------------------------------------------------------- early termination

@pytest.mark.parametrize("threshold, steps_per_update, expanded", [(0.5, 4, False), (None, 12, True)])
def test_early_termination_stops_expanding_nodes_above_the_threshold(build, tmp_path, threshold, steps_per_update,
                                                                     expanded):
    transition = Recorder(revise_with_partner_feedback)
    metrics = tmp_path / "metrics.jsonl"
    trainer = build(reward=lambda c1, c2: [1.0] * len(c1), transition=transition,
                    early_termination_threshold=threshold, metrics_path=metrics)
    trainer.train()
    logged = rows(metrics)
    assert [r["env_step"] for r in logged] == [steps_per_update, 2 * steps_per_update]
    assert all(("turn_2/reward_mean" in r) is expanded for r in logged)
    assert len(transition.calls) == (8 if expanded else 0)
    # a terminated episode's return is its immediate reward; an expanded one adds the discounted turn 2
    assert all(r["turn_1/expected_return"] == pytest.approx(1.5 if expanded else 1.0) for r in logged)


def test_early_termination_is_per_node(build, tmp_path):
    """Only the prompt whose joint actions score above the threshold stops; the other one expands."""

    def reward(prompts, completions1, completions2):
        return [1.0 if p.startswith(STORY_PROMPTS[0]) else 0.0 for p in prompts]

    transition = Recorder(revise_with_partner_feedback)
    metrics = tmp_path / "metrics.jsonl"
    build(reward=reward, transition=transition, dataset=TWO_PROMPTS, early_termination_threshold=0.5,
          metrics_path=metrics).train()
    (row,) = rows(metrics)
    assert row["env_step"] == 4 + 4  # turn 1: 2 prompts x 2; turn 2: only prompt 2's 2 children x 2
    assert {c["prompt"] for c in transition.calls} == {STORY_PROMPTS[1]} and len(transition.calls) == 2
    assert row["turn_2/reward_mean"] == 0.0
    assert row["turn_1/expected_return"] == pytest.approx(0.5)  # (1 + 1 + 0 + 0) / 4, no discounted extra


# ------------------------------------------------------------------------------------- discount

@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
def test_discount_is_applied_to_the_second_turn(build, tmp_path, discount):
    r = 0.75
    metrics = tmp_path / "metrics.jsonl"
    build(reward=lambda c1, c2: [r] * len(c1), dataset=TWO_PROMPTS, discount=discount, metrics_path=metrics).train()
    (row,) = rows(metrics)
    assert row["turn_1/reward_mean"] == pytest.approx(r) and row["turn_2/reward_mean"] == pytest.approx(r)
    assert row["turn_2/expected_return"] == pytest.approx(r)
    assert row["turn_1/expected_return"] == pytest.approx(r + discount * r)


# ------------------------------------------------------------------------------------- joint modes

def test_unknown_joint_mode_is_rejected_with_the_valid_modes():
    assert {"aligned", "cross"} <= set(JOINT_MODES)
    with pytest.raises(ValueError, match="joint_mode") as info:
        MAGRPOConfig(joint_mode="crossed")
    message = str(info.value)
    assert "'crossed'" in message and all(repr(mode) in message for mode in JOINT_MODES)
    with pytest.raises(ValueError, match="joint_mode") as info:
        joint_action_indices(2, 2, "crossed")
    assert all(repr(mode) in str(info.value) for mode in JOINT_MODES)
