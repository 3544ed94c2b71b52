"""Rollout: batched sampling per agent, joint actions, reward scoring and returns.

One home for sampling. A *node* is one prompt situation at one turn: every agent answers it with K
samples. Joint actions combine one sample of each agent; the reward function scores them, once per
batch of joint actions. Multi-turn rollouts form a tree: every joint action of turn t spawns a child
node at turn t+1 whose prompts come from `external_transition`.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from comlrl.losses import bucketed_width, completion_mask, width_buckets
from comlrl.models import decode_kernels
from comlrl.models.lean import cache_argument as lean_cache_argument
from comlrl.models.lean import (ProjectionRecord, StackedLeanDecoder, _StackedRecord, fuse_decoding, fusion_signature,
                                lean_decoder_for)
from comlrl.precision import autocast

JOINT_MODES = ("aligned", "cross")


@dataclass
class SamplingSettings:
    num_generations: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: Optional[int]


@dataclass
class AgentSamples:
    """One agent's K samples for each of a batch of prompts (rows are prompt-major)."""

    prompts: List[str]
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B*K, T)
    completion_mask: torch.Tensor  # (B*K, T) bool: trained tokens
    texts: List[str]  # (B*K)
    # The sampling pass's layer projections, for the policy-gradient pass to reuse while the
    # parameters are unchanged (`lean.ProjectionRecord`); None where sampling did not record them.
    recorded: Optional[ProjectionRecord] = None

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)


def _eos_ids(tokenizer, model) -> List[int]:
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if source is None:
            continue
        ids.update(source if isinstance(source, (list, tuple)) else [source])
    if not ids:
        raise ValueError(
            f"Tokenizer {type(tokenizer).__name__} has no eos_token_id; set one (e.g. tokenizer.eos_token = ...)"
            " so completions can end and be masked."
        )
    return sorted(ids)


def _stop_ids(tokenizer, model) -> Tuple[List[int], int]:
    """(EOS ids, pad id): rows stop at any EOS and are padded after it (with EOS if no pad token)."""
    eos_ids = _eos_ids(tokenizer, model)
    return eos_ids, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]


def sample_seed(key: Tuple) -> int:
    """A 63-bit seed that is a pure function of `key` (no global RNG involved)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def filter_logits(logits: torch.Tensor, temperature: float, top_p: float, ascending: bool = False) -> torch.Tensor:
    """Temperature, then nucleus (top-p) filtering, as transformers' warpers apply them.
    `ascending`: each row is already sorted ascending (after top-k), so no sort is needed."""
    logits = logits / temperature
    if top_p < 1.0:
        order = None
        if not ascending:
            logits_sorted, order = torch.sort(logits, dim=-1)
        else:
            logits_sorted = logits
        cumulative = logits_sorted.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1.0 - top_p
        drop[:, -1] = False  # the most likely token always survives
        if order is not None:
            drop = drop.scatter(1, order, drop)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw_tokens(logits: torch.Tensor, uniforms: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Sample one token per row: temperature -> top-k -> top-p -> inverse-CDF draw.

    With top-k, only the k best logits are sorted and normalised (everything outside them has
    probability zero after top-k anyway), so a step costs O(k log k) past the top-k instead of a
    full-vocabulary sort. Inverse-CDF sampling with one pre-drawn uniform per row is equivalent in
    distribution to torch.multinomial, and a row's draw depends only on its own uniform, so a sample
    does not change with the batch it was generated in (sharding, resume).
    """
    vocab = logits.shape[-1]
    top_k = settings.top_k if settings.top_k and settings.top_k < vocab else None
    if top_k and uniforms.dtype == torch.float32 and decode_kernels.runs(logits):
        # fp32 on the CPU: one C call for the ~15 torch ops below (a decode step's sampling, 2 agents
        # x 16 rows: ~290 -> ~40 us with caches cold from the step's weights).
        return decode_kernels.draw_tokens(logits, uniforms, top_k, settings.temperature, settings.top_p)
    if top_k:
        logits, candidates = torch.topk(logits, top_k, dim=-1)  # sorted, best first
        logits = logits.flip(-1)
        candidates = candidates.flip(-1)
    logits = filter_logits(logits, settings.temperature, settings.top_p, ascending=bool(top_k))
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    targets = uniforms.unsqueeze(-1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, targets, right=True).clamp_(max=logits.shape[-1] - 1)
    if top_k:
        picked = candidates.gather(-1, picked)
    return picked.squeeze(-1)


@dataclass
class _PromptBatch:
    """One agent's prompts as its decode starts from them."""

    prompts: List[str]
    prompt_ids: torch.Tensor  # (B, W) left-padded
    prompt_mask: torch.Tensor  # (B, W)
    positions: torch.Tensor  # (B*K, 1) position of the last prompt token
    uniforms: torch.Tensor  # (B*K, max_new) one pre-drawn uniform per row and step
    eos_ids: List[int]
    pad_id: int


def _encode_prompts(tokenizer, prompts: Sequence[str], pad_id: int, buckets: str):
    """Left-padded (ids, mask) on a bucketed width (see `bucketed_width`)."""
    previous_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = previous_side
    natural = enc["input_ids"].shape[1]
    extra = bucketed_width(natural, 2 * natural, buckets) - natural
    return F.pad(enc["input_ids"], (extra, 0), value=pad_id), F.pad(enc["attention_mask"], (extra, 0), value=0)


def _prompt_batch(prompts, prompt_ids, prompt_mask, settings: SamplingSettings, keys, eos_ids, pad_id) -> _PromptBatch:
    """One agent's prompts with their rows' positions and pre-drawn uniforms."""
    k, max_new = settings.num_generations, settings.max_new_tokens
    if len(keys) != len(prompts):
        raise ValueError(f"sample_completions got {len(keys)} keys for {len(prompts)} prompts; pass one key per prompt.")
    uniforms = torch.stack([
        torch.rand(max_new, generator=torch.Generator().manual_seed(sample_seed((key, j))), dtype=torch.float64)
        for key in keys for j in range(k)
    ]).to(prompt_ids.device)
    positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
    return _PromptBatch(list(prompts), prompt_ids, prompt_mask, positions[:, -1:].repeat_interleave(k, dim=0),
                        uniforms, eos_ids, pad_id)


def _model_prefill(model, batch: _PromptBatch, compute_dtype):
    """(next-token logits (B, vocab), transformers KV cache): each prompt through the model's own
    forward once (for architectures without a lean decoder)."""
    cache = DynamicCache(config=model.config)
    positions = (batch.prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
    with autocast(batch.prompt_ids.device, compute_dtype):
        logits = model(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, position_ids=positions,
                       use_cache=True, logits_to_keep=1, **{lean_cache_argument(model): cache}).logits[:, -1, :]
    return logits, cache


def _finish(tokenizer, batch: _PromptBatch, generated: torch.Tensor,
            recorded: Optional[ProjectionRecord] = None) -> AgentSamples:
    """AgentSamples from one agent's generated columns, cut after its longest completion."""
    mask = completion_mask(generated, batch.eos_ids)
    lengths = mask.sum(dim=1)
    steps = max(1, int(lengths.max()))  # the columns this agent's own decode would have run
    completion_ids, mask = generated[:, :steps], mask[:, :steps]
    texts = tokenizer.batch_decode(
        [row[: int(n)] for row, n in zip(completion_ids.tolist(), lengths.tolist())], skip_special_tokens=True)
    return AgentSamples(batch.prompts, batch.prompt_ids, batch.prompt_mask, completion_ids, mask, texts, recorded)


@torch.inference_mode()
def sample_agents(models: Sequence, tokenizers: Sequence, prompts: Sequence[Sequence[str]], settings: SamplingSettings,
                  keys: Sequence[Sequence[Tuple]], compute_dtypes: Sequence[Optional[torch.dtype]],
                  record_projections: bool = False) -> List[AgentSamples]:
    """Every agent's K completions for its prompts (one list per agent, same length), batched.

    Small agents (`fuse_decoding`) that share an architecture (every shape, dtype and rotary
    setting), a device, a precision and EOS/pad ids decode together as one batch
    (`StackedLeanDecoder`); any others are sampled one by one. Either way each row computes the
    same tokens: fusing changes how many calls a decode step makes, not what a row samples (see
    `sample_completions` for the sampling contract).
    """
    count = len(models)
    leans = [lean_decoder_for(m, d) if p else None for m, d, p in zip(models, compute_dtypes, prompts)]
    groups: Dict[Any, List[int]] = {}
    for i in range(count):
        if leans[i] is not None and fuse_decoding(models[i]):
            eos_ids, pad_id = _stop_ids(tokenizers[i], models[i])
            signature = (fusion_signature(leans[i]), len(prompts[i]), tuple(eos_ids), pad_id)
        else:
            signature = ("alone", i)
        groups.setdefault(signature, []).append(i)
    results: List[Optional[AgentSamples]] = [None] * count
    for members in groups.values():
        member_leans = [leans[i] for i in members]
        for i in members:
            leans[i] = None  # let the group's decode free its weight snapshots once stacked
        samples = _sample_group([models[i] for i in members], [tokenizers[i] for i in members],
                                [prompts[i] for i in members], settings, [keys[i] for i in members],
                                compute_dtypes[members[0]], member_leans, record_projections)
        for i, agent_samples in zip(members, samples):
            results[i] = agent_samples
    return results


@torch.inference_mode()
def sample_completions(model, tokenizer, prompts: Sequence[str], settings: SamplingSettings,
                       keys: Sequence[Tuple], compute_dtype: Optional[torch.dtype] = None,
                       record_projections: bool = False) -> AgentSamples:
    """Sample K completions for every prompt in one batched decode (left padding, KV cache).

    Row r = (prompt b, sample k) draws its tokens from uniforms seeded by ``(keys[b], k)``, so the
    completions are a function of the weights, the prompts and their keys: after a resume the same
    bit for bit, and whether a prompt is sampled alone, in a bigger batch or on another
    data-parallel rank, the same to float rounding (a batch pads its prompts to a common width,
    `losses.width_buckets`, and attention sums over padded columns round by where a prompt's
    columns start; a token can change only where its draw lies within that rounding of a bound).
    Sampling follows `generate`'s semantics: temperature -> top-k -> top-p, stop at EOS, pad after.
    With `compute_dtype` (mixed precision) the model's products run in that dtype (autocast).
    """
    lean = lean_decoder_for(model, compute_dtype) if prompts else None
    return _sample_group([model], [tokenizer], [prompts], settings, [keys], compute_dtype, [lean], record_projections)[0]


def _sample_group(models, tokenizers, prompts, settings: SamplingSettings, keys, compute_dtype, leans,
                  record_projections: bool = False) -> List[AgentSamples]:
    """One batched decode for a group of agents (one agent, or several that `sample_agents` found
    fusable: then every one has a lean decoder and the same number of prompts)."""
    device = next(models[0].parameters()).device
    if not prompts[0]:  # a data-parallel rank whose shard of this turn is empty
        empty = torch.zeros(0, 0, dtype=torch.long, device=device)
        return [AgentSamples([], empty, empty, empty, empty.bool(), [])]
    max_new = settings.max_new_tokens
    buckets = width_buckets(device, compute_dtype or next(models[0].parameters()).dtype)
    eos_ids, pad_ids = zip(*[_stop_ids(t, m) for t, m in zip(tokenizers, models)])
    encoded = [_encode_prompts(t, p, pad, buckets) for t, p, pad in zip(tokenizers, prompts, pad_ids)]
    width = max(ids.shape[1] for ids, _ in encoded)  # fused agents share one (bucketed) width
    encoded = [(F.pad(ids, (width - ids.shape[1], 0), value=pad), F.pad(mask, (width - mask.shape[1], 0), value=0))
               for (ids, mask), pad in zip(encoded, pad_ids)]
    # Only the model's own forward reads train/eval mode (dropout); a lean decoder runs none. Each
    # switch walks every module (~0.8 ms for the medium tiny model), so lean agents keep theirs.
    own_forward = [m for m, lean in zip(models, leans) if lean is None]
    was_training = [m.training for m in own_forward]
    for model in own_forward:
        model.eval()
    try:
        batches = [_prompt_batch(p, ids.to(device), mask.to(device), settings, key, eos, pad)
                  for p, (ids, mask), key, eos, pad in zip(prompts, encoded, keys, eos_ids, pad_ids)]
        generated, records = _decode(models[0], batches, settings, compute_dtype, leans, width, record_projections)
    finally:
        for model, training in zip(own_forward, was_training):
            model.train(training)
    rows = batches[0].positions.shape[0]
    return [_finish(t, s, generated[i * rows:(i + 1) * rows], None if records is None else records[i])
            for i, (t, s) in enumerate(zip(tokenizers, batches))]


def _decode(model, batches: List[_PromptBatch], settings: SamplingSettings, compute_dtype, leans, width: int,
            record_projections: bool = False) -> Tuple[torch.Tensor, Optional[List[ProjectionRecord]]]:
    """Prefill and decode every row of every agent's batch to EOS or max_new_tokens; returns the
    (rows, steps) tokens, agent-major, and with `record_projections`, where the decoder can
    record them, each agent's ProjectionRecord (else None). The batches go through one
    StackedLeanDecoder, or (one batch) through the model's own forward where the architecture has
    no lean decoder."""
    device = batches[0].prompt_ids.device
    max_new, k = settings.max_new_tokens, settings.num_generations
    decoder, record = None, None
    if leans[0] is not None:
        prompts = batches[0].prompt_ids.shape[0]
        decoder = StackedLeanDecoder(leans, rows=prompts * k)
        del leans[:]  # the stacked copies now hold what decoding needs
        if record_projections and decoder.can_record and not use_cuda_graphs(device, max_new):
            record = _StackedRecord(decoder, prompts, width, prompts * k, max_new)
        logits, cache = decoder.prefill(torch.cat([s.prompt_ids for s in batches]),
                                        torch.cat([s.prompt_mask for s in batches]), k, max_new, record)
    else:
        logits, cache = _model_prefill(model, batches[0], compute_dtype)
        cache.batch_repeat_interleave(k)  # the model's forward wants one cache row per row
    logits = logits.float().repeat_interleave(k, dim=0)  # each prompt's K samples start alike
    uniforms = torch.cat([s.uniforms for s in batches]).to(logits.dtype).t().contiguous()  # (max_new, rows)
    positions = torch.cat([s.positions for s in batches])
    rows = logits.shape[0]
    attention = torch.ones(rows, width + max_new, dtype=batches[0].prompt_mask.dtype, device=device)
    attention[:, :width] = torch.cat([s.prompt_mask.repeat_interleave(k, dim=0) for s in batches])
    pad_id = batches[0].pad_id
    eos = torch.tensor(batches[0].eos_ids, device=device)
    is_eos = _eos_table(eos, logits.shape[1], pad_id)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    if decoder is not None:
        bias = decoder.attention_bias(attention)
        # Step-major, so that each step's rotations are one contiguous block.
        rotations = decoder.rotary_table(positions + torch.arange(1, max_new + 1, device=device)).transpose(0, 1).contiguous()
        if use_cuda_graphs(device, max_new):
            return _graphed_decode(decoder, cache, logits, uniforms, bias, rotations, is_eos, pad_id, settings,
                                  capture=device.type == "cuda"), None
    columns = []  # each step's tokens, stacked at the end (cheaper than a strided write per step)
    for t in range(max_new):
        tokens = draw_tokens(logits, uniforms[t], settings).masked_fill_(finished, pad_id)
        columns.append(tokens)
        finished |= is_eos[tokens]
        if t + 1 == max_new or bool(finished.all()):
            break
        if decoder is not None:
            logits = decoder.step(tokens, rotations[t], cache, t, bias, record).float()
        else:
            positions = positions + 1
            with autocast(device, compute_dtype):
                logits = model(input_ids=tokens.unsqueeze(1), attention_mask=attention[:, : width + t + 1],
                               position_ids=positions, use_cache=True, logits_to_keep=1,
                               **{lean_cache_argument(model): cache}).logits[:, -1, :].float()
    return torch.stack(columns, dim=1), None if record is None else record.split(prompts, k)


def _eos_table(eos: torch.Tensor, vocab: int, pad_id: int) -> torch.Tensor:
    """A bool per token id (covering the vocabulary, the pad id and every EOS id): True at the EOS
    ids. Looking tokens up in it replaces `torch.isin`, which sorts (and syncs a GPU) when there
    are many EOS ids and costs more than an index on a decode step's few rows."""
    size = max(vocab, pad_id + 1, int(eos.max()) + 1 if eos.numel() else 0)
    is_eos = torch.zeros(size, dtype=torch.bool, device=eos.device)
    is_eos[eos] = True
    return is_eos


#: Sampling calls on a CUDA device with at least this many new tokens decode by CUDA graph replay.
CUDA_GRAPH_MIN_NEW_TOKENS = 8


def use_cuda_graphs(device: torch.device, max_new_tokens: int) -> bool:
    """Whether a lean decode on `device` replays each step as a CUDA graph (`COMLRL_CUDA_GRAPHS=0`
    turns it off). At RL batch sizes a GPU decode step is bound by launching its few hundred small
    kernels, not by the arithmetic; one replay launches them all at once."""
    return (device.type == "cuda" and max_new_tokens >= CUDA_GRAPH_MIN_NEW_TOKENS
            and os.environ.get("COMLRL_CUDA_GRAPHS", "1") != "0")


def _graphed_decode(decoder: StackedLeanDecoder, cache, logits: torch.Tensor, uniforms: torch.Tensor,
                    bias: torch.Tensor, rotations: torch.Tensor, is_eos: torch.Tensor, pad_id: int,
                    settings: SamplingSettings, capture: bool) -> torch.Tensor:
    """`_decode`'s loop with every step of one fixed shape (`StackedLeanDecoder.step` with the step
    index as a device tensor), so that, with `capture`, one step (draw, cache write, forward) is
    captured as a CUDA graph and replayed; the step counter, tokens and logits live in tensors the
    graph updates in place. Whether every row has finished is read back every `check_every` steps
    (each read waits for the GPU); steps drawn after that point write only padding, and the columns
    are cut to what the step-by-step loop returns. Without `capture` the same steps run eagerly
    (how the tests compare this path with `_decode`'s on the CPU)."""
    device = logits.device
    rows, max_new = logits.shape[0], uniforms.shape[0]
    width = bias.shape[-1] - max_new
    # Row t: -inf on the generated columns past t (not yet written at step t).
    unwritten = torch.full((max_new, max_new), float("-inf"), dtype=bias.dtype, device=device).triu_(1)
    unwritten = F.pad(unwritten, (width, 0))
    step = torch.zeros(1, dtype=torch.long, device=device)
    steps_taken = torch.zeros((), dtype=torch.long, device=device)
    logits = logits.clone()
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    generated = torch.full((rows, max_new), pad_id, dtype=torch.long, device=device)

    def advance():
        steps_taken.add_((~finished).any().long())  # the step-by-step loop takes this step
        tokens = draw_tokens(logits, uniforms.index_select(0, step).squeeze(0), settings).masked_fill_(finished, pad_id)
        generated.index_copy_(1, step, tokens.unsqueeze(1))
        finished.logical_or_(is_eos.index_select(0, tokens))
        step_bias = bias + unwritten.index_select(0, step).view(1, 1, 1, -1)
        logits.copy_(decoder.step(tokens, rotations.index_select(0, step).squeeze(0), cache, step, step_bias))
        step.add_(1)

    check_every = 8  # at most 7 steps of padding past the last EOS, against a GPU wait per step
    done = 0
    if capture:
        # The first step runs eagerly on a side stream (lazy initialisation must not be captured),
        # then the second is captured; replays take the rest.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            advance()
        torch.cuda.current_stream(device).wait_stream(side)
        done = 1
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: agents on other devices may be sampling in other threads meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                advance()  # recorded, not run
            run_step = graph.replay
        except RuntimeError as error:  # an op that cannot be captured: the same steps, eagerly
            warnings.warn(f"CUDA graph capture of the decode step failed ({error}); decoding without it. "
                          "Set COMLRL_CUDA_GRAPHS=0 to skip the attempt.", RuntimeWarning, stacklevel=2)
            run_step = advance
    else:
        run_step = advance
    while done < max_new:
        run_step()
        done += 1
        if done % check_every == 0 and bool(finished.all()):
            break
    return generated[:, : int(steps_taken)]


# --------------------------------------------------------------------------------------------------
# Reward calling
# --------------------------------------------------------------------------------------------------


def _callable_name(fn: Callable) -> str:
    target = fn
    while hasattr(target, "func"):  # functools.partial (Hydra's _partial_)
        target = target.func
    return getattr(target, "__qualname__", None) or type(target).__name__


class RewardCaller:
    """Calls a user reward function once per batch of joint actions, whatever form it takes.

    Accepted forms (N agents, M joint actions, each completions list has length M):
      f(completions1, ..., completionsN)             the seed's form for N=2
      f(prompts, completions1, ..., completionsN)    first parameter named `prompts`
      f(*completions)                                varargs
      f(*, completions, prompts=None, batch_items=None)   keyword form (completions: N lists)
    `batch_items=` (the dataset rows) is passed when the function declares it or takes **kwargs.
    """

    def __init__(self, fn: Callable, num_agents: int):
        if not callable(fn):
            raise TypeError(f"reward_func must be callable, got {type(fn).__name__}.")
        self.fn = fn
        self.num_agents = num_agents
        self.name = _callable_name(fn)
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
        names = {p.name for p in params}
        self.pass_batch_items = "batch_items" in names or any(p.kind == p.VAR_KEYWORD for p in params)
        if any(p.kind == p.VAR_POSITIONAL for p in params):
            self.form = "varargs"
        elif positional and positional[0].name == "prompts" and len(positional) == num_agents + 1:
            self.form = "prompts_first"
        elif len(positional) == num_agents:
            self.form = "positional"
        elif "completions" in names:
            self.form = "keyword"
        else:
            raise TypeError(
                f"reward_func {self.name} takes {len(positional)} required positional parameter(s) "
                f"({', '.join(p.name for p in positional) or 'none'}), but there are {num_agents} agents. "
                f"Use f(completions1, ..., completions{num_agents}), f(prompts, completions1, ...), "
                "f(*completions) or f(*, completions, prompts=None)."
            )

    def __call__(self, prompts: List[str], completions: List[List[str]], batch_items: List[dict]) -> List[float]:
        expected = len(prompts)
        extra = {"batch_items": batch_items} if self.pass_batch_items else {}
        try:
            if self.form == "keyword":
                raw = self.fn(completions=completions, prompts=prompts, **extra)
            elif self.form == "prompts_first":
                raw = self.fn(prompts, *completions, **extra)
            else:
                raw = self.fn(*completions, **extra)
        except Exception as exc:
            raise RuntimeError(
                f"reward_func {self.name} raised {type(exc).__name__}: {exc} "
                f"(called with {self.num_agents} lists of {expected} completions)."
            ) from exc
        return self._validate(raw, expected)

    def _validate(self, raw: Any, expected: int) -> List[float]:
        if isinstance(raw, torch.Tensor):
            raw = raw.detach().cpu().reshape(-1).tolist()
        elif hasattr(raw, "tolist") and not isinstance(raw, (list, tuple)):
            raw = raw.tolist()
        if not isinstance(raw, (list, tuple)):
            raise ValueError(
                f"reward_func {self.name} returned {type(raw).__name__}; it must return a list of "
                f"{expected} floats, one per joint action."
            )
        if len(raw) != expected:
            raise ValueError(
                f"reward_func {self.name} returned {len(raw)} rewards for {expected} joint actions; "
                "return exactly one float per joint action (same order as the completions lists)."
            )
        values = []
        for i, value in enumerate(raw):
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"reward_func {self.name} returned a non-number at index {i}: {value!r}.") from None
            if not math.isfinite(value):
                raise ValueError(
                    f"reward_func {self.name} returned {value} at index {i} (joint action {i}); rewards must be "
                    "finite. Fix the reward (no silent substitute value is used)."
                )
            values.append(value)
        return values


# --------------------------------------------------------------------------------------------------
# Turn batches: nodes, joint actions, returns
# --------------------------------------------------------------------------------------------------


def joint_action_indices(num_agents: int, k: int, joint_mode: str) -> torch.Tensor:
    """(J, N) sample index of each agent in each joint action of one node."""
    if joint_mode == "aligned":
        return torch.arange(k).unsqueeze(1).expand(k, num_agents).clone()
    if joint_mode == "cross":
        return torch.tensor(list(itertools.product(range(k), repeat=num_agents)), dtype=torch.long)
    raise ValueError(f"joint_mode must be one of {JOINT_MODES}, got {joint_mode!r}.")


@dataclass
class TurnBatch:
    """All nodes of one turn of an update buffer."""

    turn: int
    items: List[dict]  # dataset row of each node
    prompts: List[List[str]]  # [agent][node] prompt text used
    samples: List[AgentSamples]  # per agent, rows node-major (node n, sample k) -> n*K + k
    joint_index: torch.Tensor  # (J, N)
    rewards: torch.Tensor  # (nodes, J) immediate rewards
    parent: List[Optional[tuple]]  # (node in previous turn, joint action) or None
    history_prompts: List[List[List[str]]] = field(default_factory=list)  # [node][agent] -> prompts so far
    history_responses: List[List[List[str]]] = field(default_factory=list)  # [node][agent] -> responses so far
    returns: Optional[torch.Tensor] = None  # (nodes, J)
    expanded: Optional[torch.Tensor] = None  # (nodes,) bool: node has children

    @property
    def num_nodes(self) -> int:
        return len(self.items)

    def joint_completions(self) -> List[List[str]]:
        """[agent][node*J + j] text of each agent's part of every joint action."""
        if self.num_nodes == 0:
            return [[] for _ in self.samples]
        k = self.samples[0].completion_ids.shape[0] // self.num_nodes
        out = []
        for agent, samples in enumerate(self.samples):
            column = self.joint_index[:, agent].tolist()
            out.append([samples.texts[n * k + idx] for n in range(self.num_nodes) for idx in column])
        return out


def score_turn(turn: TurnBatch, reward: RewardCaller, num_agents: int) -> None:
    j = turn.joint_index.shape[0]
    if turn.num_nodes == 0:
        turn.rewards = torch.zeros(0, j, dtype=torch.float64)
        return
    joint = turn.joint_completions()
    prompts = [turn.prompts[0][n] for n in range(turn.num_nodes) for _ in range(j)]
    items = [turn.items[n] for n in range(turn.num_nodes) for _ in range(j)]
    values = reward(prompts, joint, items)
    turn.rewards = torch.tensor(values, dtype=torch.float64).view(turn.num_nodes, j)


def compute_returns(turns: List[TurnBatch], discount: float) -> None:
    """Return of a joint action = its reward + discount * mean return of its child node's joint actions."""
    for t in range(len(turns) - 1, -1, -1):
        turn = turns[t]
        returns = turn.rewards.clone()
        if t + 1 < len(turns):
            child_mean = turns[t + 1].returns.mean(dim=1)
            for child, parent in enumerate(turns[t + 1].parent):
                node, joint = parent
                returns[node, joint] += discount * child_mean[child]
        turn.returns = returns


def completion_returns(turn: TurnBatch, agent: int, k: int) -> torch.Tensor:
    """(nodes, K) return credited to each of this agent's completions.

    aligned: the return of the joint action the completion forms. cross: the MEAN return over the
    K^(N-1) joint actions the completion takes part in (a mean, not CoMLRL's sum, keeps returns on the
    reward scale; with advantage normalisation both give the same advantages).
    """
    index = turn.joint_index[:, agent]
    if torch.equal(index, torch.arange(k)) and turn.joint_index.shape[0] == k:
        return turn.returns.clone()
    sums = torch.zeros(turn.num_nodes, k, dtype=turn.returns.dtype)
    counts = torch.zeros(k, dtype=turn.returns.dtype)
    sums.index_add_(1, index, turn.returns)
    counts.index_add_(0, index, torch.ones_like(index, dtype=turn.returns.dtype))
    return sums / counts


def turn_sums(turns: List[TurnBatch]) -> List[List[float]]:
    """Per turn: [sum of rewards, sum of returns, joint actions], so ranks can add them up exactly."""
    return [[float(t.rewards.sum()), float(t.returns.sum()), float(t.rewards.numel())] for t in turns]


def metrics_from_sums(per_turn: List[List[float]]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for index, (reward_sum, return_sum, count) in enumerate(per_turn):
        if count:
            out[f"turn_{index + 1}/reward_mean"] = reward_sum / count
            out[f"turn_{index + 1}/expected_return"] = return_sum / count
    return out


def metrics_for_turns(turns: List[TurnBatch]) -> Dict[str, float]:
    return metrics_from_sums(turn_sums(turns))
