"""Ready-made `external_transition` functions for multi-turn MAGRPO (`num_turns > 1`).

In a multi-turn run every joint action of turn t spawns a child node at turn t+1; the trainer asks
the transition for that node's prompts, one per agent, with keyword arguments only::

    external_transition(
        prompt=...,                      # the dataset row's original "prompt" (unformatted)
        agent_completions=[...],         # this joint action: agent i's answer at turn t
        num_agents=N,
        prompt_history_per_agent=[...],  # [agent] -> prompts agent i saw at turns 1..t
        response_history_per_agent=[...],# [agent] -> answers agent i gave at turns 1..t
    ) -> list of N prompt strings

The returned strings go through the agents' formatters as the row's "prompt" (unless
`external_prompt_passthrough=True`). Both transitions below rebuild the next prompt from the
*original* prompt and the *latest* answers only, so prompts do not grow with the number of turns.

Use them directly::

    from comlrl.transitions import revise_with_partner_feedback, make_reward_feedback_transition
    MAGRPOTrainer(..., external_transition=revise_with_partner_feedback)
    MAGRPOTrainer(..., external_transition=make_reward_feedback_transition(my_reward))

or from Hydra (`_partial_: true` hands over the function itself instead of calling it)::

    external_transition:
      _target_: comlrl.transitions.revise_with_partner_feedback
      _partial_: true
    # or
    external_transition:
      _target_: comlrl.transitions.make_reward_feedback_transition
      reward_func: {_target_: comlrl.rewards.length_ratio_reward, _partial_: true}
"""

from __future__ import annotations

import importlib
from typing import Callable, List, Sequence, Union

from comlrl.rollout import RewardCaller

__all__ = ["revise_with_partner_feedback", "make_reward_feedback_transition", "REVISE_INSTRUCTION"]

REVISE_INSTRUCTION = "Revise your answer:"


def _check_inputs(agent_completions: Sequence[str], num_agents: int, who: str) -> List[str]:
    completions = list(agent_completions)
    if len(completions) != num_agents:
        raise ValueError(
            f"{who} got {len(completions)} agent_completions for num_agents={num_agents}; the trainer passes "
            "one completion per agent (the joint action being expanded)."
        )
    return completions


def _agent_label(index: int) -> str:
    return f"agent {index + 1}"  # 1-based, as researchers name them (agent 1 / agent 2)


def revise_with_partner_feedback(
    *,
    prompt: str,
    agent_completions: Sequence[str],
    num_agents: int,
    prompt_history_per_agent=None,
    response_history_per_agent=None,
    **_: object,
) -> List[str]:
    """Next prompt for each agent: the task, its own last answer, its partners' answers, and an
    instruction to revise. Each agent sees everyone's answer from the joint action being expanded,
    so the second turn is a round of "read what your teammates wrote, then improve yours".

    Format of agent i's prompt (N agents; partners listed in agent order, labels 1-based)::

        <original prompt>

        Your previous answer (agent i+1):
        <agent_completions[i]>

        Answer of agent j+1:            # one block per partner j != i
        <agent_completions[j]>

        Revise your answer:

    Histories are accepted (the trainer always passes them) but only the latest answers are used,
    so the prompt length does not grow with the turn number.

    >>> revise_with_partner_feedback(prompt="Q?", agent_completions=["a", "b"], num_agents=2)[0]
    'Q?\\n\\nYour previous answer (agent 1):\\na\\n\\nAnswer of agent 2:\\nb\\n\\nRevise your answer:'
    """
    completions = _check_inputs(agent_completions, num_agents, "revise_with_partner_feedback")
    prompts = []
    for i in range(num_agents):
        blocks = [prompt, f"Your previous answer ({_agent_label(i)}):\n{completions[i]}"]
        blocks += [f"Answer of {_agent_label(j)}:\n{completions[j]}" for j in range(num_agents) if j != i]
        blocks.append(REVISE_INSTRUCTION)
        prompts.append("\n\n".join(blocks))
    return prompts


def _resolve_callable(reward_func: Union[Callable, str]) -> Callable:
    if isinstance(reward_func, str):  # "package.module.function", handy in configs and on the CLI
        module_name, _, attr = reward_func.rpartition(".")
        if not module_name:
            raise ValueError(f"reward_func={reward_func!r} is not a dotted import path "
                             "like 'comlrl.rewards.length_ratio_reward'.")
        try:
            reward_func = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"reward_func={reward_func!r} cannot be imported ({exc}).") from exc
    if not callable(reward_func):
        raise TypeError("make_reward_feedback_transition needs a callable reward_func, "
                        f"got {type(reward_func).__name__}.")
    return reward_func


def make_reward_feedback_transition(
    reward_func: Union[Callable, str],
    template: str = "Previous joint score: {score:.2f}. Improve it.",
) -> Callable[..., List[str]]:
    """Build a transition that tells the agents how well their last joint answer scored.

    At each expansion the returned transition scores the joint action being expanded with
    `reward_func`, called on that single joint action exactly as the trainer calls it for a batch of
    one: ``reward_func([c1], [c2], ..., [cN])[0]`` (the seed form; a function whose first parameter is
    named ``prompts`` gets ``[prompt]`` first, and the keyword form ``f(*, completions, prompts)`` works
    too). The score is the raw reward (before any `reward_processor`): for a deterministic reward it is
    the reward the trainer gave that joint action at turn t. The reward is called once per expanded
    joint action (aligned: K per prompt per turn), on top of the trainer's own batched call.

    Format of agent i's prompt::

        <original prompt>

        Your previous answer:
        <agent_completions[i]>

        Previous joint score: 0.37. Improve it.      # `template`, formatted with score=<float>

    Pass your own `template` (it must contain ``{score}``, with any format spec) to change the last
    line. `reward_func` may be a dotted import path string. A reward that raises, returns no number,
    or returns NaN/inf fails with an error naming the function; no substitute score is invented.

    The returned function's ``__qualname__`` carries the reward's name, so the checkpoint's
    `external_transition` fingerprint changes (and resume refuses) when the feedback reward is
    swapped for another function.
    """
    reward_func = _resolve_callable(reward_func)
    if "{score" not in template:
        raise ValueError(f"template must contain '{{score}}' (e.g. 'Score: {{score:.2f}}'), got {template!r}.")
    try:
        template.format(score=0.5)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"template {template!r} cannot be formatted with score=<float> ({exc}).") from exc
    reward_name = _callable_name(reward_func)
    callers = {}

    def reward_feedback_transition(
        *,
        prompt: str,
        agent_completions: Sequence[str],
        num_agents: int,
        prompt_history_per_agent=None,
        response_history_per_agent=None,
        **_: object,
    ) -> List[str]:
        completions = _check_inputs(agent_completions, num_agents, "reward_feedback_transition")
        score = _score_joint_action(reward_func, callers, prompt, completions)
        feedback = template.format(score=score)
        return [f"{prompt}\n\nYour previous answer:\n{completions[i]}\n\n{feedback}" for i in range(num_agents)]

    reward_feedback_transition.__qualname__ = f"make_reward_feedback_transition[{reward_name}]"
    reward_feedback_transition.reward_func = reward_func  # for inspection / tests
    return reward_feedback_transition


def _callable_name(fn: Callable) -> str:
    while hasattr(fn, "func"):  # functools.partial (Hydra's _partial_)
        fn = fn.func
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _score_joint_action(reward_func, callers, prompt: str, completions: List[str]) -> float:
    """The reward of one joint action, through the trainer's own reward-form dispatch and checks
    (wrong length, non-number, NaN/inf and exceptions all raise an error naming the function)."""
    num_agents = len(completions)
    caller = callers.get(num_agents)
    if caller is None:
        caller = callers[num_agents] = RewardCaller(reward_func, num_agents)
    # The transition only knows the row's prompt, so that is all `batch_items` can carry.
    return caller([prompt], [[c] for c in completions], [{"prompt": prompt}])[0]
