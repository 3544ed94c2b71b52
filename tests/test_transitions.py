"""comlrl.transitions: exact prompt formats, how the feedback reward is called, errors, Hydra use."""

from __future__ import annotations

import functools

import pytest
from hydra.utils import instantiate

from comlrl.checkpoint import callable_fingerprint
from comlrl.rewards import length_ratio_reward
from comlrl.transitions import REVISE_INSTRUCTION, make_reward_feedback_transition, revise_with_partner_feedback


def call(transition, completions, prompt="Write a poem:"):
    """Call a transition exactly as the trainer does (keywords only, histories included)."""
    n = len(completions)
    return transition(prompt=prompt, agent_completions=list(completions), num_agents=n,
                      prompt_history_per_agent=[[prompt] for _ in range(n)],
                      response_history_per_agent=[[c] for c in completions])


# ------------------------------------------------------------------------------- revise_with_partner_feedback

def test_revise_two_agents_exact_format():
    first, second = call(revise_with_partner_feedback, ["roses", "violets"])
    assert first == ("Write a poem:\n\nYour previous answer (agent 1):\nroses\n\n"
                     "Answer of agent 2:\nviolets\n\nRevise your answer:")
    assert second == ("Write a poem:\n\nYour previous answer (agent 2):\nviolets\n\n"
                      "Answer of agent 1:\nroses\n\nRevise your answer:")
    assert first.endswith(REVISE_INSTRUCTION)


def test_revise_three_agents_lists_every_partner_in_order():
    prompts = call(revise_with_partner_feedback, ["A", "B", "C"])
    assert len(prompts) == 3
    middle = prompts[1].split("\n\n")
    assert middle == ["Write a poem:", "Your previous answer (agent 2):\nB", "Answer of agent 1:\nA",
                      "Answer of agent 3:\nC", REVISE_INSTRUCTION]


def test_revise_uses_the_latest_answers_only():
    """Later turns do not pile up old answers: the prompt depends on the original prompt and the
    joint action being expanded, not on the history."""
    base = call(revise_with_partner_feedback, ["x", "y"])
    with_history = revise_with_partner_feedback(
        prompt="Write a poem:", agent_completions=["x", "y"], num_agents=2,
        prompt_history_per_agent=[["p1", "p2"], ["p1", "p2"]], response_history_per_agent=[["old", "x"], ["old", "y"]])
    assert with_history == base and "old" not in "".join(with_history)


def test_revise_rejects_a_completion_count_that_does_not_match_num_agents():
    with pytest.raises(ValueError, match="got 1 agent_completions for num_agents=2"):
        revise_with_partner_feedback(prompt="p", agent_completions=["only one"], num_agents=2)


# ------------------------------------------------------------------------------- reward feedback

def test_feedback_scores_the_single_joint_action_and_reports_it():
    seen = []

    def reward(completions1, completions2):
        seen.append((completions1, completions2))
        return [0.37]

    prompts = call(make_reward_feedback_transition(reward), ["short", "a longer answer"])
    assert seen == [(["short"], ["a longer answer"])]  # once, on one joint action
    assert prompts == [
        "Write a poem:\n\nYour previous answer:\nshort\n\nPrevious joint score: 0.37. Improve it.",
        "Write a poem:\n\nYour previous answer:\na longer answer\n\nPrevious joint score: 0.37. Improve it.",
    ]


def test_feedback_score_matches_the_reward_the_trainer_would_give():
    reward = functools.partial(length_ratio_reward, low=2.0, high=3.0)
    expected = length_ratio_reward(["abcd"], ["ab"])[0]
    prompts = call(make_reward_feedback_transition(reward, template="score={score:.4f}"), ["abcd", "ab"])
    assert prompts[0].endswith(f"score={expected:.4f}") and expected < 1.0


@pytest.mark.parametrize("form", ["prompts_first", "keyword", "three_agents"])
def test_feedback_accepts_the_trainers_reward_forms(form):
    got = {}

    def prompts_first(prompts, completions1, completions2):
        got["prompts"] = prompts
        return [0.5]

    def keyword(*, completions, prompts=None):
        got["completions"] = completions
        return [0.5]

    def three_agents(c1, c2, c3):
        got["n"] = (len(c1), len(c2), len(c3))
        return [0.5]

    fn = {"prompts_first": prompts_first, "keyword": keyword, "three_agents": three_agents}[form]
    completions = ["a", "b", "c"] if form == "three_agents" else ["a", "b"]
    prompts = call(make_reward_feedback_transition(fn), completions, prompt="Task")
    assert len(prompts) == len(completions)
    assert all(p.endswith("Previous joint score: 0.50. Improve it.") for p in prompts)
    if form == "prompts_first":
        assert got["prompts"] == ["Task"]
    elif form == "keyword":
        assert got["completions"] == [["a"], ["b"]]
    else:
        assert got["n"] == (1, 1, 1)


@pytest.mark.parametrize("bad, error, message", [
    (lambda c1, c2: [float("nan")], ValueError, "returned nan"),
    (lambda c1, c2: [0.1, 0.2], ValueError, "returned 2 rewards for 1 joint actions"),
    (lambda c1, c2: 1 / 0, RuntimeError, "raised ZeroDivisionError"),
])
def test_feedback_reward_errors_name_the_function(bad, error, message):
    with pytest.raises(error, match=message) as info:
        call(make_reward_feedback_transition(bad), ["a", "b"])
    assert "<lambda>" in str(info.value)


def test_feedback_template_and_reward_are_checked_up_front():
    with pytest.raises(ValueError, match="must contain '{score}'"):
        make_reward_feedback_transition(length_ratio_reward, template="Try again.")
    with pytest.raises(ValueError, match="cannot be formatted"):
        make_reward_feedback_transition(length_ratio_reward, template="{score} {other}")
    with pytest.raises(TypeError, match="callable reward_func"):
        make_reward_feedback_transition(0.5)
    with pytest.raises(ValueError, match="cannot be imported"):
        make_reward_feedback_transition("comlrl.rewards.no_such_reward")


def test_feedback_reward_by_dotted_path():
    transition = make_reward_feedback_transition("comlrl.rewards.length_ratio_reward")
    assert transition.reward_func is length_ratio_reward
    assert call(transition, ["ab", "abcde"])[0].endswith("Previous joint score: 1.00. Improve it.")


def test_feedback_fingerprint_is_stable_and_follows_the_reward():
    """Checkpoints fingerprint the transition: rebuilding it for a resume must match, swapping the
    feedback reward must not."""

    def other_reward(completions1, completions2):
        return [0.0] * len(completions1)

    one = callable_fingerprint(make_reward_feedback_transition(length_ratio_reward))
    assert one == callable_fingerprint(make_reward_feedback_transition(length_ratio_reward))
    assert one != callable_fingerprint(make_reward_feedback_transition(other_reward))
    assert "length_ratio_reward" in one


def test_hydra_instantiation():
    revise = instantiate({"_target_": "comlrl.transitions.revise_with_partner_feedback", "_partial_": True})
    assert call(revise, ["a", "b"]) == call(revise_with_partner_feedback, ["a", "b"])
    feedback = instantiate({
        "_target_": "comlrl.transitions.make_reward_feedback_transition",
        "reward_func": {"_target_": "comlrl.rewards.length_ratio_reward", "_partial_": True, "low": 2.0, "high": 3.0},
    })
    assert call(feedback, ["ab", "abcde"])[1].endswith("Previous joint score: 1.00. Improve it.")
