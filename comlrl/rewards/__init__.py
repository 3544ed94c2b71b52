"""Reward functions: plain callables over completions, returning one float per joint action.

The trainer calls a reward function once per batch of joint actions, with one list of completion
strings per agent (`completions1[j]` and `completions2[j]` form joint action j).

* `length_ratio_reward(completions1, completions2)`: the seed example's two-agent task.
* `length_ladder_reward(*completions)`: its N-agent generalisation (each agent writes longer than
  the one before it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["length_ratio_reward", "length_ladder_reward"]


def length_ratio_reward(
    completions1: Sequence[str],
    completions2: Sequence[str],
    low: float = 2.0,
    high: float = 3.0,
) -> list[float]:
    """Reward agent 2 for writing `low`-`high` times as many characters as agent 1.

    This is the cooperative task of the seed example: agent 1 writes a short piece, agent 2 an
    elaboration 2-3x longer. For each joint action the ratio is
    ``len(completion2) / max(len(completion1), 1)`` (the `max` keeps an empty first completion
    from dividing by zero). The reward is 1.0 inside ``[low, high]`` and decays smoothly as
    ``exp(-d)`` outside, where ``d`` is the distance from the ratio to the nearest bound, so the
    signal still points the right way far from the target.

    Lengths are in characters (``len`` of the decoded string), not tokens, so the reward does not
    depend on the tokenizer.

    >>> length_ratio_reward(["ab"], ["abcde"])
    [1.0]
    """
    if len(completions1) != len(completions2):
        raise ValueError(
            f"length_ratio_reward got {len(completions1)} completions for agent 1 but "
            f"{len(completions2)} for agent 2; they must pair up one-to-one."
        )
    if not low <= high:
        raise ValueError(f"length_ratio_reward needs low <= high, got low={low}, high={high}.")

    rewards = []
    for first, second in zip(completions1, completions2):
        ratio = len(second) / max(len(first), 1)
        if ratio < low:
            distance = low - ratio
        elif ratio > high:
            distance = ratio - high
        else:
            distance = 0.0
        rewards.append(math.exp(-distance))  # exp(0) == 1.0 exactly inside the band
    return rewards


def length_ladder_reward(
    *completions: Sequence[str],
    low: float = 1.5,
    high: float = 2.5,
) -> list[float]:
    """N-agent length ladder: every agent should write `low`-`high` times as many characters as the
    agent before it (agent 2 vs agent 1, agent 3 vs agent 2, ...).

    Takes one list of completions per agent (``length_ladder_reward(c1, c2, c3)`` for three agents;
    any N >= 2). For joint action j each neighbouring pair (i, i+1) is scored exactly like
    `length_ratio_reward` scores its pair: 1.0 when ``len(c_{i+1}[j]) / max(len(c_i[j]), 1)`` lies in
    ``[low, high]``, ``exp(-distance to the band)`` outside. The reward is the mean of the N-1 pair
    scores, so it stays in (0, 1] and every agent's length matters. With two agents it equals
    ``length_ratio_reward(c1, c2, low, high)``.

    Lengths are in characters, so the reward does not depend on the tokenizer. (The band score is
    written out here rather than shared with `length_ratio_reward`: a checkpoint fingerprints a
    reward by the source of the function itself, so all of its logic belongs in its own body.)

    >>> length_ladder_reward(["ab"], ["abcd"], ["abcdefgh"])
    [1.0]
    >>> length_ladder_reward(["ab"], ["abcd"], ["abcd"])   # mean of 1.0 and exp(-(1.5 - 1.0))
    [0.8032653298563167]
    """
    if len(completions) < 2:
        raise ValueError(
            f"length_ladder_reward needs the completions of at least 2 agents, got {len(completions)} "
            "list(s); call it as length_ladder_reward(completions1, completions2, ...)."
        )
    sizes = [len(c) for c in completions]
    if len(set(sizes)) != 1:
        raise ValueError(
            f"length_ladder_reward got {sizes} completions per agent; every agent's list must have "
            "one completion per joint action (equal lengths)."
        )
    if not low <= high:
        raise ValueError(f"length_ladder_reward needs low <= high, got low={low}, high={high}.")

    pairs = len(completions) - 1
    rewards = []
    for joint in zip(*completions):
        total = 0.0
        for shorter, longer in zip(joint[:-1], joint[1:]):
            ratio = len(longer) / max(len(shorter), 1)
            distance = low - ratio if ratio < low else ratio - high if ratio > high else 0.0
            total += math.exp(-distance)  # 1.0 inside the band
        rewards.append(total / pairs)
    return rewards
