"""Token log-probs, completion masks, group advantages and the policy-gradient loss.

Everything here is a pure tensor function so it can be pinned by hand-computed tests.
"""

from __future__ import annotations

from typing import Iterable

import torch

ADVANTAGE_MODES = ("mean", "raw", "max", "rloo")
LOSS_TYPES = ("sum", "token_mean", "seq_mean")


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: Iterable[int]) -> torch.Tensor:
    """Which completion tokens are trained: everything up to and including the first EOS.

    `generate` pads finished rows after their EOS (often with the EOS id itself, as Qwen does), so
    only the *first* EOS counts. A row without EOS ran to `max_new_tokens`; all of it is trained,
    including its last token.
    """
    eos = torch.as_tensor(sorted(set(eos_token_ids)), device=completion_ids.device, dtype=completion_ids.dtype)
    is_eos = torch.isin(completion_ids, eos).to(torch.int32)
    eos_before = is_eos.cumsum(dim=1) - is_eos
    return eos_before == 0


def completion_token_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask_: torch.Tensor,
) -> torch.Tensor:
    """Log-probs of each completion token under `model`, from one padded forward.

    `prompt_ids` are left-padded, so every completion starts at the same column and its logits are
    the last `T` positions. Only those positions go through the LM head (`logits_to_keep`), and the
    log-softmax normaliser is taken with `logsumexp` so no full-vocabulary log-prob tensor is kept.
    Position ids follow the attention mask exactly as `generate` builds them, so these log-probs are
    those of the distribution the tokens were sampled from (before temperature/top-k/top-p).
    """
    num_completion_tokens = completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask_[:, :-1].to(prompt_mask.dtype)], dim=1)
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=num_completion_tokens,
    ).logits.float()
    picked = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def group_advantages(returns: torch.Tensor, mode: str = "mean", normalize: bool = True) -> torch.Tensor:
    """Advantages within each group of K completions (last dim), as MAGRPO defines them.

    mean: r - mean(r); raw: r; max: r - max(r); rloo: r - mean of the *other* K-1 returns.
    With `normalize`, each group is then standardised (population std, floored at 1e-6 so a group of
    equal returns yields zero advantages instead of NaN).
    """
    if mode == "mean":
        adv = returns - returns.mean(dim=-1, keepdim=True)
    elif mode == "raw":
        adv = returns.clone()
    elif mode == "max":
        adv = returns - returns.max(dim=-1, keepdim=True).values
    elif mode == "rloo":
        k = returns.shape[-1]
        adv = (returns * k - returns.sum(dim=-1, keepdim=True)) / (k - 1)
    else:
        raise ValueError(f"advantage_mode must be one of {ADVANTAGE_MODES}, got {mode!r}.")
    if normalize and returns.shape[-1] > 1:
        mean = adv.mean(dim=-1, keepdim=True)
        std = adv.std(dim=-1, unbiased=False, keepdim=True).clamp(min=1e-6)
        adv = (adv - mean) / std
    return adv


def policy_gradient_loss(
    token_logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    loss_type: str = "sum",
) -> torch.Tensor:
    """REINFORCE loss over a minibatch of sequences (rows), each with one advantage.

    sum:        mean over sequences of -(sum of token log-probs) * A  (CoMLRL's scale)
    seq_mean:   mean over sequences of -(mean of token log-probs) * A
    token_mean: -(sum over all tokens of log-prob * A) / number of trained tokens
    """
    mask = mask.to(token_logprobs.dtype)
    weighted = token_logprobs * mask * advantages.unsqueeze(-1)
    if loss_type == "sum":
        return -weighted.sum(dim=1).mean()
    if loss_type == "seq_mean":
        return -(weighted.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if loss_type == "token_mean":
        return -weighted.sum() / mask.sum().clamp(min=1)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.")
