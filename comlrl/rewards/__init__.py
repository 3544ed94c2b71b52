"""Reward functions: plain callables over completions, returning one float per joint action.

The trainer calls a reward function once per batch of joint actions, with one list of completion
strings per agent (`completions1[j]` and `completions2[j]` form joint action j).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["length_ratio_reward"]


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
