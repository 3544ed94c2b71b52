"""Token log-probs, completion masks, group advantages and the policy-gradient loss.

Everything here is a pure tensor function so it can be pinned by hand-computed tests.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from transformers import DynamicCache

from comlrl.models import onednn
from comlrl.models.lean import cache_argument, shared_prompt_logits
from comlrl.precision import autocast, training_attention

ADVANTAGE_MODES = ("mean", "raw", "max", "rloo")
LOSS_TYPES = ("sum", "token_mean", "seq_mean")


WIDTH_BUCKETS = ("exact", "fine", "coarse")


def bucketed_width(width: int, limit: int, buckets: str = "fine") -> int:
    """The width (tokens) a batch of sequences is padded to, at most `limit`; the masks hide the
    padding. `buckets` (`width_buckets` picks it): "exact" keeps the width, "fine" rounds it up to
    a multiple of 8, "coarse" to the next of 8, 12, 16, 24, 32, 48, 64, 96, ... (two steps per
    doubling: at most half again as wide).
    """
    if buckets not in WIDTH_BUCKETS:
        raise ValueError(f"bucketed_width: buckets must be one of {WIDTH_BUCKETS} (got {buckets!r})")
    if buckets == "exact":
        return min(limit, width)
    if buckets == "fine":
        return min(limit, -(-width // 8) * 8)
    if width <= 8:
        return min(limit, 8)
    power = 1 << (width - 1).bit_length()
    return min(limit, power * 3 // 4 if width <= power * 3 // 4 else power)


def width_buckets(device: torch.device, dtype: torch.dtype) -> str:
    """The `bucketed_width` rounding for products of `dtype` on `device`.

    GPUs get "fine" buckets (multiples of 8). On the CPU, products that run through oneDNN (fp32
    ones on AVX-512 CPUs that are not Intel's, `onednn.FP32_THROUGH_ONEDNN`; other dtypes wherever
    PyTorch has oneDNN) get "coarse" ones: oneDNN generates and caches a kernel per shape (~1 MB
    each), and with fine widths a run makes hundreds of shapes, each a fresh kernel build, its
    memory growing with them (L benchmark in bf16: 650 shapes and 1.1 GB unbucketed, 120 and
    0.7 GB coarse). Everywhere else on the CPU (fp32 through MKL and the C kernels, which cost
    nothing per shape) widths stay "exact": padding there is only work. On an AVX2-only EPYC
    (Zen 3), the L benchmark's prompts went from 72 columns a sampling call (coarse) to 59 (every
    decode step's attention reads them all) and its training chunks from 1,904 prompt rows to
    1,622: its 16 sampling calls, alternating in one process, 15.01 -> 14.10 s (3 rounds; 14.47 s
    with fine buckets), its updates' backward passes 16.77 -> 16.59 s (2 rounds).
    """
    if device.type != "cpu":
        return "fine"
    through_onednn = onednn.FP32_THROUGH_ONEDNN if dtype == torch.float32 else onednn.AVAILABLE
    return "coarse" if through_onednn else "exact"


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


def shared_prompt_token_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask_: torch.Tensor,
    group_size: int,
    compute_dtype: Optional[torch.dtype] = None,
    replayed=None,
) -> torch.Tensor:
    """Log-probs (rows, T) of each completion token, for groups of `group_size` completions that
    share one prompt (completion rows are group-major; `prompt_ids` has one left-padded row per group).

    Each prompt goes through the model once and its keys/values serve the K completions of its
    group, whose tokens attend to them: the prompt part of the forward and backward is done once
    per group instead of K times (the gradient through the shared prefix is the sum over the group,
    as with K copies). Position ids follow the attention mask as `generate` builds them, so these are
    the log-probs of the distribution the tokens were sampled from (before temperature/top-k/top-p).
    Only the completion positions go through the LM head, and the normaliser is taken with
    `logsumexp`, so no full-vocabulary log-prob tensor is kept for the prompt.

    Llama-family models on the CPU run the lean forward (`comlrl.models.lean.shared_prompt_logits`);
    others run the transformers forward twice (prompt with a cache, then the completions). With
    `compute_dtype` the matrix products run in that dtype (autocast for the transformers forward).
    `replayed` (`ProjectionRecord.replayed`) gives the lean forward its layers' projections from the
    sampling pass that made these completions with these parameters.
    """
    logits = shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, group_size, compute_dtype, replayed)
    if logits is None:
        device = prompt_ids.device
        with training_attention(model, device, compute_dtype), autocast(device, compute_dtype):
            logits = _transformers_shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids,
                                                        completion_mask_, group_size)
    picked = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _transformers_shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask_,
                                       group_size: int) -> torch.Tensor:
    """`shared_prompt_token_logprobs`' logits through the model's own forward, for any architecture:
    the prompt with a KV cache, repeated for each group's K completions, then the completions."""
    prompt_positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    first = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_positions, use_cache=True,
                  logits_to_keep=1, **{cache_argument(model): cache}).logits[:, -1:].float()
    logits = first.repeat_interleave(group_size, dim=0)  # predicts each completion's first token
    steps = completion_ids.shape[1]
    if steps > 1:
        cache.batch_repeat_interleave(group_size)
        attention = torch.cat([prompt_mask.repeat_interleave(group_size, dim=0),
                               completion_mask_[:, :-1].to(prompt_mask.dtype)], dim=1)
        positions = prompt_positions[:, -1:].repeat_interleave(group_size, dim=0) + 1 + torch.arange(
            steps - 1, device=prompt_ids.device)
        rest = model(input_ids=completion_ids[:, :-1], attention_mask=attention, position_ids=positions,
                     use_cache=True, **{cache_argument(model): cache}).logits.float()
        logits = torch.cat([logits, rest], dim=1)
    return logits
