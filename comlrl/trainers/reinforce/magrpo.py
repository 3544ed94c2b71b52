"""MAGRPO: multi-agent group-relative policy optimisation.

Every agent samples K completions per prompt, joint actions of the agents are scored by one reward
function, and each completion's advantage is its return relative to its group of K. The loop in
`MAGRPOTrainer.train` reads top to bottom, one phase per block:
rollout -> reward -> returns -> advantage/loss/step per agent -> log -> checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import gc
import logging
import math
import os
import random
import shutil
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from comlrl import __version__
from comlrl import checkpoint as ckpt
from comlrl import faults
from comlrl.distributed import DistContext
from comlrl.logging import MetricsSink
from comlrl.models import lean, pages
from comlrl.precision import MIXED_PRECISION_MODES, compute_dtype
from comlrl.losses import (
    ADVANTAGE_MODES,
    LOSS_TYPES,
    bucketed_width,
    group_advantages,
    policy_gradient_loss,
    shared_prompt_token_logprobs,
    width_buckets,
)
from comlrl.rollout import (
    JOINT_MODES,
    AgentSamples,
    RewardCaller,
    SamplingSettings,
    TurnBatch,
    compute_returns,
    completion_returns,
    joint_action_indices,
    metrics_for_turns,
    metrics_from_sums,
    sample_agents,
    sample_completions,
    score_turn,
    turn_sums,
)

log = logging.getLogger(__name__)

# Settings that may change when a run is resumed: they shape how long it runs, where it runs and
# how it reports, never what it computes. Everything else must match the checkpoint.
RUN_SHAPE_KEYS = frozenset(
    {"num_train_epochs", "logging_steps", "agent_devices", "eval_interval", "eval_num_samples",
     "show_progress", "allow_resume_drift", "log_completions", "max_forward_tokens"}
)
# Exit status of a run stopped by SIGTERM/SIGUSR1/SIGINT after writing its checkpoint (EX_TEMPFAIL:
# "try again"), so schedulers and `make resume` can tell a preemption from a failure.
PREEMPTED_EXIT_CODE = 75


@contextlib.contextmanager
def _setup_objects_frozen():
    """Python's cyclic garbage collector leaves the objects alive when training starts alone until
    it is over (`gc.freeze`), unless `COMLRL_FREEZE_GC=0` or something froze objects already.

    After loading transformers, models and datasets the process holds ~400,000 tracked objects,
    and the first full collection during training walks them all: 0.24-0.28 s at the L benchmark's
    shape (AVX2 EPYC), one pause inside the first update, for almost nothing collected. Frozen,
    they are skipped; objects made during training are collected as before, and `gc.unfreeze` hands
    the frozen ones back to the collector when training ends. What it costs: a reference cycle
    among objects that existed before training is freed only after it."""
    if os.environ.get("COMLRL_FREEZE_GC", "1") == "0" or gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _help(text: str, **kwargs):
    return field(metadata={"help": text}, **kwargs)


@dataclass
class MAGRPOConfig:
    """All MAGRPO settings. Names and defaults follow CoMLRL 1.4.3 so curves stay comparable."""

    num_train_epochs: int = _help("Total epochs of the run (a resumed run counts the epochs already done).", default=20)
    agent_learning_rate: float = _help("AdamW learning rate of every agent.", default=5.0e-6)
    logging_steps: int = _help("Log a row when env_step advanced by at least this much since the last row.", default=50)
    num_agents: Optional[int] = _help("Number of agents; defaults to len(agents) (2 for agent_model).", default=None)
    num_generations: int = _help("K: completions sampled per agent per prompt (the group size, >= 2).", default=4)
    max_new_tokens: int = _help("Maximum tokens per completion.", default=256)
    temperature: float = _help("Sampling temperature (> 0).", default=0.6)
    top_p: float = _help("Nucleus sampling mass in (0, 1].", default=0.6)
    top_k: Optional[int] = _help("Top-k sampling; None or 0 disables it.", default=50)
    num_turns: int = _help("Turns per episode; > 1 needs an external_transition.", default=2)
    discount: float = _help("Discount applied to the next turn's return, in [0, 1].", default=1.0)
    joint_mode: str = _help("'aligned': sample j of every agent forms joint action j (K per prompt); "
                            "'cross': all K^N combinations.", default="aligned")
    early_termination_threshold: Optional[float] = _help(
        "Stop expanding a node to the next turn when its mean reward exceeds this; None = never.", default=None)
    external_prompt_passthrough: bool = _help(
        "Use external_transition's prompts as they are, instead of passing them through the formatters.", default=False)
    eval_interval: int = _help("Evaluate before the update holding every eval_interval-th prompt of an epoch; 0 = off.",
                               default=16)
    eval_num_samples: int = _help("Eval dataset rows per evaluation.", default=4)
    rollout_buffer_size: int = _help("Prompts per update: all are sampled in one batched call per agent.", default=2)
    train_batch_size: Optional[int] = _help("Prompts (nodes) per optimizer step within an update; None = rollout_buffer_size.",
                                            default=None)
    advantage_normalization: bool = _help("Standardise advantages within each group of K.", default=True)
    advantage_mode: str = _help("Group baseline: mean | raw | max | rloo.", default="mean")
    loss_type: str = _help("sum (CoMLRL's per-sequence log-prob sum) | token_mean | seq_mean.", default="sum")
    agent_devices: Optional[Union[str, List[str]]] = _help(
        "Device for all agents ('cpu', 'cuda:0') or one per agent; None = cuda:0 if available else cpu.", default=None)
    seed: int = _help("Seeds python, numpy and torch at the start of a fresh run.", default=0)
    show_progress: bool = _help("Show a tqdm progress bar over updates.", default=True)
    mixed_precision: str = _help(
        "Dtype of the matrix products in sampling and the loss: 'no' (the model's dtype), 'bf16' (autocast; "
        "weights, gradients and AdamW state stay in the model's dtype), 'auto' = bf16 on CUDA devices that "
        "support it, the model's dtype elsewhere (CPU runs stay exact unless set to 'bf16').", default="auto")
    max_forward_tokens: Optional[int] = _help(
        "Tokens per padded forward/backward chunk of a minibatch (gradients accumulate over chunks); None = 1024 "
        "on CPU (measured faster and leaner there than one big forward or smaller chunks), 65536 on GPU.", default=None)
    log_completions: int = _help("Joint actions (prompt, each agent's completion, reward) recorded with every logged "
                                 "row, to completions.jsonl and a W&B table; 0 = off.", default=0)
    allow_resume_drift: List[str] = _help(
        "Escape hatch: config keys or fingerprints (model_<i>, tokenizer_<i>, train_dataset, reward_func, "
        "external_transition) allowed to differ from the checkpoint on resume; ['*'] allows all.", default_factory=list)

    def __post_init__(self) -> None:
        problems = []

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.num_train_epochs) and self.num_train_epochs >= 1, f"num_train_epochs must be an int >= 1 (got {self.num_train_epochs!r})")
        need(self.agent_learning_rate > 0, f"agent_learning_rate must be > 0 (got {self.agent_learning_rate})")
        need(is_int(self.logging_steps) and self.logging_steps >= 1, f"logging_steps must be an int >= 1 (got {self.logging_steps!r})")
        need(self.num_agents is None or (is_int(self.num_agents) and self.num_agents >= 1), f"num_agents must be None or >= 1 (got {self.num_agents!r})")
        need(is_int(self.num_generations) and self.num_generations >= 2,
             f"num_generations must be >= 2: the group baseline needs at least two samples (got {self.num_generations!r})")
        need(is_int(self.max_new_tokens) and self.max_new_tokens >= 1, f"max_new_tokens must be >= 1 (got {self.max_new_tokens!r})")
        need(self.temperature > 0, f"temperature must be > 0 (got {self.temperature})")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p})")
        need(self.top_k is None or (is_int(self.top_k) and self.top_k >= 0), f"top_k must be None or >= 0 (got {self.top_k!r})")
        need(is_int(self.num_turns) and self.num_turns >= 1, f"num_turns must be >= 1 (got {self.num_turns!r})")
        need(0 <= self.discount <= 1, f"discount must be in [0, 1] (got {self.discount})")
        need(self.joint_mode in JOINT_MODES, f"joint_mode must be one of {list(JOINT_MODES)} (got {self.joint_mode!r})")
        need(is_int(self.eval_interval) and self.eval_interval >= 0, f"eval_interval must be >= 0 (got {self.eval_interval!r})")
        need(self.max_forward_tokens is None or (is_int(self.max_forward_tokens) and self.max_forward_tokens >= 1),
             f"max_forward_tokens must be None or >= 1 (got {self.max_forward_tokens!r})")
        need(is_int(self.log_completions) and self.log_completions >= 0, f"log_completions must be >= 0 (got {self.log_completions!r})")
        need(is_int(self.eval_num_samples) and self.eval_num_samples >= 0, f"eval_num_samples must be >= 0 (got {self.eval_num_samples!r})")
        need(is_int(self.rollout_buffer_size) and self.rollout_buffer_size >= 1, f"rollout_buffer_size must be >= 1 (got {self.rollout_buffer_size!r})")
        if self.train_batch_size is None:
            self.train_batch_size = self.rollout_buffer_size
        need(is_int(self.train_batch_size) and self.train_batch_size >= 1, f"train_batch_size must be >= 1 (got {self.train_batch_size!r})")
        need(self.advantage_mode in ADVANTAGE_MODES, f"advantage_mode must be one of {list(ADVANTAGE_MODES)} (got {self.advantage_mode!r})")
        need(self.loss_type in LOSS_TYPES, f"loss_type must be one of {list(LOSS_TYPES)} (got {self.loss_type!r})")
        need(self.mixed_precision in MIXED_PRECISION_MODES,
             f"mixed_precision must be one of {list(MIXED_PRECISION_MODES)} (got {self.mixed_precision!r})")
        self.allow_resume_drift = list(self.allow_resume_drift or [])
        if problems:
            raise ValueError("Invalid MAGRPOConfig:\n  - " + "\n  - ".join(problems))


def _adamw(agent, learning_rate: float) -> torch.optim.AdamW:
    """AdamW over the agent's parameters, with torch's fused kernel where it has one (CPU and CUDA
    floating-point tensors): one kernel per parameter instead of a dozen. Measured on the medium
    tiny model (4 layers x 256, one CPU thread): 1.6-2.6 ms per step instead of 5.4-6.0 ms. It
    rounds a few weights differently in the last bit than the per-tensor loop; a run is exact
    against itself either way (resume included)."""
    params = list(agent.parameters())
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=learning_rate, fused=True if fused else None)


class _GradientBuffers:
    """Every agent's gradient buffers, allocated once before the first rollout and lent to one agent
    at a time, zeroed in place between minibatches.

    Allocated by each backward pass instead (`zero_grad(set_to_none=True)`), gradients land among
    that pass's activations and the sampling call's buffers on the CPU heap, and the memory around
    them cannot be given back: L benchmark, fp32, peak RSS 669 -> 651 MB, S-medium 607 -> 598-601 MB
    (AVX2 EPYC) with buffers kept. Agents update one after another and an agent's optimizer step
    spends its gradients before the next agent's backward pass begins, so agents whose trainable
    parameters match in shape, stride, dtype and device (the usual case: copies of one model) take
    turns with one set: peak RSS S-medium 614-616 -> 604-605 MB, L 680-683 -> 674 MB (fp32,
    AVX-512 EPYC, time unchanged). While an agent holds no loan its gradients are None."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self._params = [[p for group in o.param_groups for p in group["params"] if p.requires_grad]
                        for o in optimizers]
        shared: Dict[tuple, List[torch.Tensor]] = {}
        self._buffers = []
        for params in self._params:
            signature = tuple((tuple(p.shape), p.stride(), p.dtype, p.device) for p in params)
            if signature not in shared:
                shared[signature] = [torch.zeros_like(p) for p in params]
            self._buffers.append(shared[signature])

    def lend_zeroed(self, agent_index: int) -> Dict[int, int]:
        """Give agent `agent_index`'s parameters their buffers, zeroed; returns each buffer's version,
        for `_drop_unused_gradients`."""
        versions = {}
        for p, buffer in zip(self._params[agent_index], self._buffers[agent_index]):
            p.grad = buffer.zero_()
            versions[id(p)] = buffer._version
        return versions

    def take_back(self, agent_index: int) -> None:
        """The agent's update is done: its parameters let go of the buffers."""
        for p in self._params[agent_index]:
            p.grad = None


def _training_mode(agent) -> None:
    """`agent.train()`, skipped where every module is in training mode already (sampling through a
    lean decoder leaves the mode alone): the call walks every module and costs ~0.8 ms on the
    medium tiny model, once per agent and update. Every switch of mode goes through `train()`
    (`eval()` too), so a model's hub-kernel mode, which `train()` also sets, follows its modules'."""
    if not all(module.training for module in agent.modules()):
        agent.train()


def _drop_unused_gradients(optimizer: torch.optim.Optimizer, versions: Dict[int, int]) -> None:
    """Set to None every gradient the backward pass did not write to since it was lent zeroed
    (a parameter the loss did not use, e.g. an expert no token was routed to), so the optimizer
    skips that parameter, as it does when gradients start out as None."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and versions.get(id(p)) == p.grad._version:
                p.grad = None


def _reject_unknown_settings(init):
    """Wrap the dataclass __init__ so a misspelt setting names its closest valid spelling."""
    names = [f.name for f in dataclasses.fields(MAGRPOConfig)]

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            hints = [f"{key!r} (did you mean {difflib.get_close_matches(key, names, n=1)[0]!r}?)"
                     if difflib.get_close_matches(key, names, n=1) else repr(key) for key in unknown]
            raise TypeError(f"MAGRPOConfig got unknown setting(s) {', '.join(hints)}. Valid settings: {', '.join(names)}.")
        init(self, *args, **kwargs)

    return checked_init


MAGRPOConfig.__init__ = _reject_unknown_settings(MAGRPOConfig.__init__)


class TrainingPreempted(SystemExit):
    """Raised after a stop signal once the current update is done and its checkpoint is written."""

    def __init__(self, message: str):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class MAGRPOTrainer:
    """Trains N cooperating causal-LM agents with MAGRPO. `trainer.agents` are the trained models."""

    def __init__(
        self,
        agent_model: Optional[str] = None,
        agents: Optional[Sequence[torch.nn.Module]] = None,
        num_agents: Optional[int] = None,
        tokenizer=None,
        train_dataset=None,
        eval_dataset=None,
        reward_func: Optional[Callable] = None,
        reward_processor: Optional[Callable[[float], float]] = None,
        formatters: Optional[Union[Callable, Sequence[Callable]]] = None,
        external_transition: Optional[Callable] = None,
        wandb_config: Optional[Dict[str, Any]] = None,
        args: Optional[MAGRPOConfig] = None,
        metrics_path: Optional[str] = None,
        completions_path: Optional[str] = None,
        model_config: Optional[Dict[str, Any]] = None,
    ):
        self.args = args if args is not None else MAGRPOConfig()
        if not isinstance(self.args, MAGRPOConfig):
            raise TypeError(f"args must be a MAGRPOConfig, got {type(self.args).__name__}.")
        a = self.args

        # Agents and tokenizers ----------------------------------------------------------------
        if agents is None:
            if agent_model is None:
                raise ValueError("Pass agents=[model, ...] (or agent_model='name-or-path' for identical copies).")
            from comlrl.models import load_causal_lm

            count = num_agents or a.num_agents or 2
            agents = [load_causal_lm(agent_model, **(model_config or {})) for _ in range(count)]
            if tokenizer is None:
                from comlrl.models import load_tokenizer

                tokenizer = load_tokenizer(agent_model)
        self.agents: List[torch.nn.Module] = list(agents)
        self.num_agents = len(self.agents)
        for declared in (num_agents, a.num_agents):
            if declared is not None and declared != self.num_agents:
                raise ValueError(f"num_agents={declared} but {self.num_agents} agents were given; drop num_agents or make them agree.")
        if self.num_agents < 2:
            raise ValueError(f"MAGRPO trains cooperating agents: pass at least 2 agents (got {self.num_agents}).")
        if tokenizer is None:
            raise ValueError("tokenizer is required (one for all agents, or a list with one per agent).")
        self.tokenizers = list(tokenizer) if isinstance(tokenizer, (list, tuple)) else [tokenizer] * self.num_agents
        if len(self.tokenizers) != self.num_agents:
            raise ValueError(f"Got {len(self.tokenizers)} tokenizers for {self.num_agents} agents; pass one, or one per agent.")
        self.tokenizer = self.tokenizers[0]
        for tok in self.tokenizers:
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token  # batched sampling needs a pad id; EOS is the usual choice

        self.dist = DistContext.from_environment("cuda" if torch.cuda.is_available() else "cpu")
        self.devices = self._resolve_devices(a.agent_devices)
        self._concurrent_rollout = len(set(self.devices)) > 1
        self.compute_dtypes = [compute_dtype(a.mixed_precision, device) for device in self.devices]
        self._rollout_pool: Optional[ThreadPoolExecutor] = None
        for agent, device in zip(self.agents, self.devices):
            agent.to(device)

        # Task ------------------------------------------------------------------------------------
        if num_turns_needs_transition := (a.num_turns > 1 and external_transition is None):
            raise ValueError(
                f"num_turns={a.num_turns} needs an external_transition that builds the next turn's prompts; "
                "pass external_transition=..., or num_turns=1 for single-turn training."
            )
        del num_turns_needs_transition
        self.external_transition = external_transition
        self.formatters = self._resolve_formatters(formatters)
        self.train_dataset = self._check_dataset(train_dataset, "train_dataset", required=True)
        self.eval_dataset = self._check_dataset(eval_dataset, "eval_dataset", required=False)
        if reward_func is None:
            raise ValueError("reward_func is required: f(completions1, ..., completionsN) -> list of floats.")
        self.reward_func = reward_func
        self.reward = RewardCaller(reward_func, self.num_agents)
        self.reward_processor = reward_processor
        if a.joint_mode == "cross" and a.num_generations ** self.num_agents > 4096:
            raise ValueError(f"joint_mode='cross' with K={a.num_generations} and {self.num_agents} agents scores "
                             f"{a.num_generations ** self.num_agents} joint actions per prompt; use 'aligned' or fewer generations.")

        self.optimizers = [_adamw(agent, a.agent_learning_rate) for agent in self.agents]
        self.gradients = _GradientBuffers(self.optimizers)
        self.sampling = SamplingSettings(a.num_generations, a.max_new_tokens, a.temperature, a.top_p, a.top_k)
        self.joint_index = joint_action_indices(self.num_agents, a.num_generations, a.joint_mode)
        if completions_path is None and metrics_path is not None and a.log_completions:
            completions_path = str(Path(metrics_path).with_name("completions.jsonl"))
        self.logger = MetricsSink(wandb_config, metrics_path, enabled=self.dist.is_main, completions_path=completions_path)
        self.wandb_config = wandb_config

        # Progress (restored from a checkpoint on resume) -----------------------------------------
        self.run_id: Optional[str] = None
        self.env_step = 0
        self.updates_done = 0
        self.last_logged_step = -1
        self._stop_signal: Optional[str] = None
        self._fingerprint_cache: Optional[Dict[str, Optional[str]]] = None
        self._pending_eval: Dict[str, float] = {}

    # ============================================================================================
    # The training loop
    # ============================================================================================

    def train(
        self,
        resume_from_checkpoint: Optional[str] = None,
        checkpoint_dir: Optional[str] = None,
        checkpoint_interval: int = 1,
        checkpoint_total_limit: Optional[int] = None,
        checkpoint_steps: Optional[int] = None,
        **unused: Any,
    ) -> Dict[str, Any]:
        """Train for `num_train_epochs` in total, writing `checkpoint-<epochs>` every
        `checkpoint_interval` epochs and after the last one (and `step-<updates>` every
        `checkpoint_steps` updates). `resume_from_checkpoint`: a checkpoint path, "auto" (latest
        complete one in `checkpoint_dir`, or a fresh start when there is none) or None (fresh)."""
        if unused:
            raise TypeError(f"train() got unexpected arguments {sorted(unused)}.")
        a = self.args
        for name, value, minimum in (("checkpoint_interval", checkpoint_interval, 1),
                                     ("checkpoint_total_limit", checkpoint_total_limit, 1),
                                     ("checkpoint_steps", checkpoint_steps, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise ValueError(f"{name} must be a positive integer or None (got {value!r}).")
        checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None

        # Resume or start fresh: every check happens before anything is written.
        state = self._prepare_start(resume_from_checkpoint, checkpoint_dir)
        progress = state["progress"] if state else {"epoch": 0, "buffer_in_epoch": 0}
        total_epochs = a.num_train_epochs
        buffers = self._epoch_buffers()
        total_updates = total_epochs * len(buffers)
        if self.updates_done >= total_updates:
            log.info("Run %s already completed %d epochs; nothing to do (raise num_train_epochs to continue).",
                     self.run_id, total_epochs)
            return self._summary()

        if any(torch.device(d).type == "cpu" for d in self.devices):
            pages.keep_freed_memory()  # each step's tensors reuse the last one's pages
        self.logger.start(self._run_config(), (state or {}).get("wandb"), self.last_logged_step)
        bar = tqdm(total=total_updates, initial=self.updates_done, desc="MAGRPO", unit="update",
                   disable=not (a.show_progress and self.dist.is_main), dynamic_ncols=True)
        try:
            with self._stop_signals(), _setup_objects_frozen():
                for epoch in range(progress["epoch"], total_epochs):
                    first = progress["buffer_in_epoch"] if epoch == progress["epoch"] else 0
                    for buffer_index in range(first, len(buffers)):
                        bar.set_description(f"MAGRPO epoch {epoch + 1}/{total_epochs}")
                        positions = buffers[buffer_index]
                        shard = self.dist.shard(positions)
                        items = [self.train_dataset[i] for i in shard]
                        self._maybe_evaluate(positions)

                        # 1. rollout + 2. reward + 3. returns
                        turns = self._rollout(items, [("train", a.seed, epoch, p) for p in shard], for_training=True)
                        compute_returns(turns, a.discount)

                        # 4. advantage, loss and optimizer step, agent by agent
                        agent_stats = [self._update_agent(i, turns) for i in range(self.num_agents)]
                        self.updates_done += 1

                        # 5. log
                        self._log_update(turns, agent_stats, epoch + (buffer_index + 1) / len(buffers))
                        bar.update(1)
                        bar.set_postfix(step=self.env_step)

                        # 6. checkpoint
                        end_of_epoch = buffer_index == len(buffers) - 1
                        position = {"epoch": epoch + 1 if end_of_epoch else epoch,
                                    "buffer_in_epoch": 0 if end_of_epoch else buffer_index + 1}
                        stop = self._stop_signal_everywhere()  # decided once, so a stop always has its checkpoint
                        if checkpoint_dir is not None and end_of_epoch and (
                                (epoch + 1) % checkpoint_interval == 0 or epoch + 1 == total_epochs):
                            self._save(checkpoint_dir / f"checkpoint-{epoch + 1}", position, "epoch", checkpoint_total_limit)
                        elif checkpoint_dir is not None and (
                                stop or (checkpoint_steps and self.updates_done % checkpoint_steps == 0)):
                            self._save(checkpoint_dir / f"step-{self.updates_done}", position, "step", checkpoint_total_limit)
                        faults.point("update_end")
                        if stop:
                            raise TrainingPreempted(
                                f"Stopped by {self._stop_signal or 'a stop signal on another rank'} after update "
                                f"{self.updates_done} (env_step {self.env_step})"
                                + (f"; checkpoint written to {checkpoint_dir}; resume with resume_from_checkpoint='auto'"
                                   if checkpoint_dir is not None else "; no checkpoint_dir was set, so nothing was saved")
                            )
        finally:
            bar.close()
            self.logger.close()
        return self._summary()

    def _stop_signal_everywhere(self) -> bool:
        # Ranks must agree, or one would wait forever in a collective the others never reach.
        return self.dist.any_flag(self._stop_signal is not None)

    # ============================================================================================
    # Phases
    # ============================================================================================

    def _rollout(self, items: List[dict], keys: List[tuple], dist: Optional[DistContext] = None,
                 for_training: bool = False) -> List[TurnBatch]:
        """Sample every turn of the episodes starting at `items`; score each turn's joint actions.

        `keys` name each episode (seed, split, epoch, dataset position); a node's samples are drawn
        from uniforms seeded by its key, its path in the tree and the agent, so they do not depend on
        batching, sharding or resume. `dist` is the group the env_step count is summed over.
        """
        a = self.args
        dist = dist or self.dist
        num_joint = self.joint_index.shape[0]
        prompts = [[fmt(item) for item in items] for fmt in self.formatters]
        parents: List[Optional[tuple]] = [None] * len(items)
        history_prompts = [[[] for _ in range(self.num_agents)] for _ in items]
        history_responses = [[[] for _ in range(self.num_agents)] for _ in items]
        node_items = list(items)
        node_keys = list(keys)
        turns: List[TurnBatch] = []
        for turn_index in range(a.num_turns):
            # Only the first turn's projections can be replayed: the update's first optimizer step
            # (a minibatch of turn 1) moves the parameters before any later turn is trained.
            samples = self._sample_all_agents(prompts, node_keys, record_projections=for_training and turn_index == 0)
            turn = TurnBatch(turn_index, node_items, prompts, samples, self.joint_index, None, parents,
                             history_prompts, history_responses)
            score_turn(turn, self.reward, self.num_agents)
            faults.point("reward")
            if self.reward_processor is not None:
                turn.rewards = turn.rewards.apply_(self.reward_processor)
            self.env_step += sum(dist.all_gather_int(turn.rewards.numel()))
            turns.append(turn)
            if turn_index == a.num_turns - 1:
                break
            # Every joint action of a node that is not terminated spawns a child node.
            joint_texts = turn.joint_completions()
            next_prompts = [[] for _ in range(self.num_agents)]
            parents, node_items, history_prompts, history_responses, parent_keys = [], [], [], [], node_keys
            node_keys = []
            for node in range(turn.num_nodes):
                threshold = a.early_termination_threshold
                if threshold is not None and float(turn.rewards[node].mean()) > threshold:
                    continue
                for j in range(num_joint):
                    chosen = [joint_texts[i][node * num_joint + j] for i in range(self.num_agents)]
                    hist_p = [turn.history_prompts[node][i] + [turn.prompts[i][node]] for i in range(self.num_agents)]
                    hist_r = [turn.history_responses[node][i] + [chosen[i]] for i in range(self.num_agents)]
                    item = turn.items[node]
                    new = self.external_transition(prompt=item.get("prompt", ""), agent_completions=chosen,
                                                   num_agents=self.num_agents, prompt_history_per_agent=hist_p,
                                                   response_history_per_agent=hist_r)
                    if not isinstance(new, (list, tuple)) or len(new) != self.num_agents:
                        raise ValueError(f"external_transition must return a list of {self.num_agents} prompts (one per "
                                         f"agent), got {type(new).__name__} of length {len(new) if hasattr(new, '__len__') else '?'}.")
                    for i in range(self.num_agents):
                        next_prompts[i].append(new[i] if a.external_prompt_passthrough
                                               else self.formatters[i]({**item, "prompt": new[i]}))
                    parents.append((node, j))
                    node_keys.append(parent_keys[node] + (j,))
                    node_items.append(item)
                    history_prompts.append(hist_p)
                    history_responses.append(hist_r)
            if not dist.any_flag(bool(parents)):
                break
            prompts = next_prompts
        return turns

    def _sample_all_agents(self, prompts: List[List[str]], node_keys: List[tuple],
                           record_projections: bool = False) -> List[AgentSamples]:
        """Every agent's samples for one turn. Agents on one device that share an architecture
        decode as one batch (`sample_agents`); agents on different devices sample concurrently (one
        thread per agent: kernels of different GPUs overlap while Python waits). Samples are keyed,
        so the result is the same either way. With `record_projections` (a training rollout),
        sampling keeps its layer projections where it can, for the update to reuse
        (`lean.ProjectionRecord`)."""
        keys = [[key + (f"agent_{i}",) for key in node_keys] for i in range(self.num_agents)]
        record_projections = record_projections and lean.REUSE_SAMPLING_PROJECTIONS

        def sample(i: int) -> AgentSamples:
            return sample_completions(self.agents[i], self.tokenizers[i], prompts[i], self.sampling,
                                      keys=keys[i], compute_dtype=self.compute_dtypes[i],
                                      record_projections=record_projections)

        if self._concurrent_rollout:
            if self._rollout_pool is None:
                self._rollout_pool = ThreadPoolExecutor(max_workers=self.num_agents, thread_name_prefix="comlrl-agent")
            results = list(self._rollout_pool.map(sample, range(self.num_agents)))
            for _ in results:
                faults.point("generate")
            return results
        results = sample_agents(self.agents, self.tokenizers, prompts, self.sampling, keys, self.compute_dtypes,
                                record_projections)
        for _ in results:
            faults.point("generate")
        return results

    def _update_agent(self, agent_index: int, turns: List[TurnBatch]) -> Dict[str, float]:
        """Policy-gradient steps for one agent over all nodes of the update, turn by turn.

        Minibatches are drawn from the *global* node order (every rank shuffles the same list with the
        same python RNG), so data parallelism reproduces the single-process minibatches; each rank
        computes the rows it holds, scaled by its share, and the gradients are summed across ranks.
        """
        a = self.args
        agent, optimizer = self.agents[agent_index], self.optimizers[agent_index]
        k = a.num_generations
        device = self.devices[agent_index]
        scaled_losses, length_sum, length_count = [], 0.0, 0
        _training_mode(agent)
        for turn in turns:
            samples = turn.samples[agent_index]
            advantages = group_advantages(completion_returns(turn, agent_index, k).float(),
                                          a.advantage_mode, a.advantage_normalization).to(device)
            length_sum += float(samples.completion_lengths.float().sum())
            length_count += int(samples.completion_lengths.numel())
            counts = self.dist.all_gather_int(turn.num_nodes)
            offset = sum(counts[:self.dist.rank])
            node_order = list(range(sum(counts)))
            random.shuffle(node_order)  # minibatch order, as CoMLRL (python RNG, checkpointed)
            for start in range(0, len(node_order), a.train_batch_size):
                minibatch = node_order[start:start + a.train_batch_size]
                local = [g - offset for g in minibatch if offset <= g < offset + turn.num_nodes]
                share = self._rank_share(samples, local, len(minibatch))
                kept = self.gradients.lend_zeroed(agent_index)
                # Each rank's loss is a mean over its rows (or tokens); weighted by its share of the
                # global minibatch, the sum over ranks is the single-process loss.
                loss = self._minibatch_backward(agent, samples, advantages, local, 1.0 if share is None else share,
                                                self.compute_dtypes[agent_index], samples.recorded)
                faults.point("backward")
                _drop_unused_gradients(optimizer, kept)
                self.dist.sum_gradients(list(agent.parameters()))
                optimizer.step()
                # The sampling pass's projections (`lean.ProjectionRecord`) hold for the parameters
                # that sampled: after this agent's first step no minibatch may replay them.
                for stale in turns:
                    if stale.samples[agent_index].recorded is not None:
                        stale.samples[agent_index].recorded.release()
                        stale.samples[agent_index].recorded = None
                faults.point("optimizer_step")
                scaled_losses.append(loss)
        self.gradients.take_back(agent_index)
        totals = self.dist.all_gather_object((scaled_losses, length_sum, length_count))
        losses = [sum(values) for values in zip(*[t[0] for t in totals])]
        lengths = sum(t[1] for t in totals) / max(sum(t[2] for t in totals), 1)
        return {"loss": float(np.mean(losses)), "completion_length": float(lengths),
                "learning_rate": float(optimizer.param_groups[0]["lr"])}

    def _rank_share(self, samples, nodes_local: List[int], global_nodes: int) -> Optional[float]:
        """This rank's fraction of the minibatch's rows (tokens for token_mean); None without DP."""
        if not self.dist.enabled:
            return None
        k = self.args.num_generations
        if self.args.loss_type != "token_mean":
            return len(nodes_local) / global_nodes
        rows = [n * k + j for n in nodes_local for j in range(k)]
        local = float(samples.completion_mask[rows].sum()) if rows else 0.0
        return local / max(self.dist.sum_float(local), 1.0)

    def _minibatch_backward(self, agent, samples, advantages: torch.Tensor, nodes_local: List[int],
                            share: float, dtype: Optional[torch.dtype], record=None) -> float:
        """Backward of this rank's part of one minibatch's loss; returns the loss value.

        Nodes go through the model in chunks of about `max_forward_tokens` tokens. Within a chunk each
        node's prompt is computed once and shared by its K completions (`shared_prompt_token_logprobs`).
        Each chunk's loss is weighted by its share of the rows (tokens for token_mean) and
        back-propagated at once, so the accumulated gradient is that of the whole minibatch while only
        one chunk's activations are alive at a time. With `record` (`lean.ProjectionRecord` of
        these samples, made with the current parameters), the forward reuses the sampling pass's
        layer projections instead of multiplying again."""
        a, k = self.args, self.args.num_generations
        if not nodes_local:
            return 0.0
        device = advantages.device
        nodes = torch.tensor(nodes_local, device=device)
        rows = (nodes.unsqueeze(1) * k + torch.arange(k, device=device)).reshape(-1)
        mask = samples.completion_mask[rows]
        trained_tokens = float(mask.sum())
        prompt_width = int(samples.prompt_mask[nodes].any(dim=0).sum())
        budget = a.max_forward_tokens or (1024 if device.type == "cpu" else 65536)
        buckets = width_buckets(device, dtype or next(agent.parameters()).dtype)
        nodes_per_chunk = max(1, budget // (prompt_width + k * int(mask.sum(dim=1).max())))
        total = 0.0
        for start in range(0, len(nodes_local), nodes_per_chunk):
            chunk_nodes = nodes[start:start + nodes_per_chunk]
            chunk = slice(start * k, (start + len(chunk_nodes)) * k)
            prompt_ids, prompt_mask = samples.prompt_ids[chunk_nodes], samples.prompt_mask[chunk_nodes]
            # Drop the columns that are padding in every row (left of the prompts, right of the
            # completions: the mask is a prefix), widths rounded as `width_buckets` says for these
            # products (a few shapes where oneDNN builds a kernel per shape, else exact).
            prompt_columns = prompt_mask.shape[1]
            first_column = prompt_columns - bucketed_width(
                prompt_columns - int(prompt_mask.any(dim=0).nonzero()[0]), prompt_columns, buckets)
            chunk_mask = mask[chunk]
            width = bucketed_width(int(chunk_mask.sum(dim=1).max()), chunk_mask.shape[1], buckets)
            replayed = None if record is None else record.replayed(nodes_local[start:start + nodes_per_chunk],
                                                                   first_column, width - 1)
            logprobs = shared_prompt_token_logprobs(agent, prompt_ids[:, first_column:], prompt_mask[:, first_column:],
                                                    samples.completion_ids[rows[chunk], :width], chunk_mask[:, :width], k,
                                                    dtype, replayed)
            loss = policy_gradient_loss(logprobs, chunk_mask[:, :width], advantages.reshape(-1)[rows[chunk]], a.loss_type)
            weight = (float(chunk_mask.sum()) / max(trained_tokens, 1.0) if a.loss_type == "token_mean"
                      else chunk_mask.shape[0] / len(rows))
            weight *= share
            if weight != 1.0:  # skip the multiply when there is one chunk and one rank (bitwise the same loss)
                loss = loss * weight
            loss.backward()
            total += float(loss.detach())
        return total

    def _log_update(self, turns: List[TurnBatch], agent_stats: List[Dict[str, float]], epoch: float) -> None:
        step = self.env_step
        # The cadence depends on training progress alone, so turning eval on never moves a training row;
        # pending eval metrics ride along with the next row that is due.
        due = self.last_logged_step < 0 or step - self.last_logged_step >= self.args.logging_steps
        if not due:
            return
        per_rank = self.dist.all_gather_object(turn_sums(turns))
        metrics = metrics_from_sums([[sum(values) for values in zip(*parts)] for parts in zip(*per_rank)])
        for i, stats in enumerate(agent_stats):
            metrics.update({f"agent_{i}/{name}": value for name, value in stats.items()})
        metrics["train/epoch"] = epoch
        metrics.update(self._pending_eval)
        self._pending_eval = {}
        self.last_logged_step = step
        self.logger.log(step, metrics, self._completion_samples(turns))

    def _completion_samples(self, turns: List[TurnBatch]) -> List[Dict[str, Any]]:
        """The first `log_completions` joint actions of each turn of this update (deterministic, no RNG)."""
        limit = self.args.log_completions
        out: List[Dict[str, Any]] = []
        for turn in turns if limit else []:
            texts = turn.joint_completions()
            per_node = turn.joint_index.shape[0]
            for flat in range(min(limit, turn.rewards.numel())):
                node = flat // per_node
                out.append({"turn": turn.turn + 1, "prompt": turn.prompts[0][node],
                            "completions": [texts[i][flat] for i in range(self.num_agents)],
                            "reward": float(turn.rewards.view(-1)[flat])})
        return out

    # ============================================================================================
    # Evaluation (own RNG stream, so turning it on leaves the training trajectory unchanged)
    # ============================================================================================

    def _maybe_evaluate(self, positions: List[int]) -> None:
        a = self.args
        if self.eval_dataset is None or a.eval_interval == 0 or a.eval_num_samples == 0 or not self.dist.is_main:
            return
        if not any(p % a.eval_interval == 0 for p in positions):
            return
        self._pending_eval = self.evaluate()

    def evaluate(self, num_eval_samples: Optional[int] = None) -> Dict[str, float]:
        """One sampled joint episode per eval row; metrics under ``eval/``.

        Eval samples come from their own keys (split "eval"), never from a training stream, so turning
        evaluation on leaves the training trajectory bit-identical."""
        if self.eval_dataset is None:
            return {}
        n = min(self.args.eval_num_samples if num_eval_samples is None else num_eval_samples, len(self.eval_dataset))
        items = [self.eval_dataset[i] for i in range(n)]
        keys = [("eval", self.args.seed, self.env_step, i) for i in range(n)]
        saved_sampling, saved_joint, saved_step = self.sampling, self.joint_index, self.env_step
        try:
            self.sampling = dataclasses.replace(self.sampling, num_generations=1)
            self.joint_index = joint_action_indices(self.num_agents, 1, "aligned")
            turns = self._rollout(items, keys, dist=DistContext())  # rank 0 alone: no collectives
            compute_returns(turns, self.args.discount)
        finally:
            self.sampling, self.joint_index, self.env_step = saved_sampling, saved_joint, saved_step
        return {f"eval/{k}": v for k, v in metrics_for_turns(turns).items()}

    # ============================================================================================
    # Start, resume, checkpoints
    # ============================================================================================

    def _prepare_start(self, resume_from_checkpoint, checkpoint_dir: Optional[Path]) -> Optional[Dict[str, Any]]:
        path = None
        if resume_from_checkpoint == "auto":
            if checkpoint_dir is None:
                raise ValueError("resume_from_checkpoint='auto' needs checkpoint_dir to look in.")
            path = ckpt.find_latest_checkpoint(checkpoint_dir)
        elif resume_from_checkpoint is not None:
            path = Path(resume_from_checkpoint)
            if not path.exists():
                raise FileNotFoundError(f"resume_from_checkpoint={str(path)!r} does not exist. Pass an existing "
                                        "checkpoint directory, 'auto', or None for a fresh run.")

        if path is None:
            self.run_id = self.dist.all_gather_object(uuid.uuid4().hex)[0]  # rank 0's id for every rank
            self._check_checkpoint_dir(checkpoint_dir)
            # python RNG (minibatch shuffles) must agree on every rank; sampling streams must differ.
            random.seed(self.args.seed)
            np.random.seed(self.args.seed)
            torch.manual_seed(ckpt.rank_seed(self.args.seed, self.dist.rank))
            return None

        problem = ckpt.checkpoint_problem(path)
        if problem is not None:
            raise ckpt.CheckpointError(f"Cannot resume from {path}: {problem}. Use an earlier complete checkpoint, or "
                                       "resume_from_checkpoint='auto' to pick the latest complete one.")
        state = ckpt.read_trainer_state(path)
        metadata = ckpt.read_checkpoint_metadata(path)
        self._check_drift(state, path)
        done_epochs = state["progress"]["epoch"]
        if done_epochs > self.args.num_train_epochs:
            raise ValueError(f"Checkpoint {path} has already completed {done_epochs} epochs, more than "
                             f"num_train_epochs={self.args.num_train_epochs}. num_train_epochs counts the whole run: "
                             f"set it to at least {done_epochs}.")
        self.run_id = metadata["run_id"]
        self._check_checkpoint_dir(checkpoint_dir)
        ckpt.load_checkpoint(path, self.agents, self.optimizers, rank=self.dist.rank, world_size=self.dist.world_size,
                             seed=self.args.seed)
        progress = state["progress"]
        self.env_step = progress["env_step"]
        self.updates_done = progress["updates_done"]
        self.last_logged_step = progress["last_logged_step"]
        state["wandb"] = metadata["wandb"]
        log.info("Resumed run %s from %s at epoch %d, env_step %d.", self.run_id, path, done_epochs, self.env_step)
        return state

    def _check_checkpoint_dir(self, checkpoint_dir: Optional[Path]) -> None:
        if checkpoint_dir is None:
            return
        for existing in ckpt.list_checkpoints(checkpoint_dir):
            try:
                owner = ckpt.read_trainer_state(existing)["run_id"]
            except Exception:
                continue
            if owner != self.run_id:
                raise ValueError(
                    f"checkpoint_dir {checkpoint_dir} already holds checkpoints of another run ({existing.name}, run "
                    f"{owner}). Resume that run with resume_from_checkpoint='auto' (or a path), or use an empty "
                    "checkpoint_dir; nothing was overwritten."
                )
        problem = None
        if self.dist.is_main:  # rank 0 prepares the directory
            try:
                checkpoint_dir.mkdir(parents=True, exist_ok=True)
                for stale in checkpoint_dir.glob(f"{ckpt.TMP_PREFIX}*"):  # left by a process killed mid-write
                    shutil.rmtree(stale, ignore_errors=True)
                probe = checkpoint_dir / f".write-probe-{uuid.uuid4().hex[:8]}"
                probe.write_text("")
                probe.unlink()
            except OSError as exc:
                problem = str(exc)
        # Every rank learns rank 0's verdict, so none waits for a rank that already failed.
        problem = self.dist.all_gather_object(problem)[0]
        if problem is not None:
            raise PermissionError(f"checkpoint_dir {checkpoint_dir} is not writable ({problem}); choose a writable "
                                  "directory before training so no work is lost.")

    def _fingerprints(self) -> Dict[str, Optional[str]]:
        # The setup cannot change while a trainer exists; hash the dataset and friends only once.
        if self._fingerprint_cache is not None:
            return dict(self._fingerprint_cache)
        prints: Dict[str, Optional[str]] = {}
        for i, agent in enumerate(self.agents):
            prints[f"model_{i}"] = ckpt.model_fingerprint(getattr(agent, "module", agent))
            prints[f"tokenizer_{i}"] = ckpt.tokenizer_fingerprint(self.tokenizers[i])
        prints["train_dataset"] = ckpt.dataset_fingerprint(self.train_dataset)
        prints["reward_func"] = ckpt.callable_fingerprint(self.reward_func)
        prints["external_transition"] = ckpt.callable_fingerprint(self.external_transition)
        self._fingerprint_cache = prints
        return dict(prints)

    def _check_drift(self, state: Dict[str, Any], path: Path) -> None:
        allowed = set(RUN_SHAPE_KEYS) | set(self.args.allow_resume_drift)
        if "*" in allowed:
            return
        config_lines = ckpt.config_drift(state["config"], ckpt.dataclass_to_dict(self.args), allowed)
        print_lines = ckpt.config_drift(state["fingerprints"], self._fingerprints(), allowed)
        if config_lines or print_lines:
            raise ValueError(
                f"Cannot resume from {path}: the run's setup changed since the checkpoint.\n  - "
                + "\n  - ".join(config_lines + [f"fingerprint {line}" for line in print_lines])
                + f"\nOnly run-shape settings may change ({', '.join(sorted(RUN_SHAPE_KEYS))}). Restore the original "
                "settings, or list deliberate changes in MAGRPOConfig.allow_resume_drift. Nothing was written."
            )

    def _save(self, target: Path, position: Dict[str, int], kind: str, total_limit: Optional[int]) -> None:
        identity = self.logger.identity()
        progress = {**position, "updates_done": self.updates_done, "env_step": self.env_step,
                    "last_logged_step": self.last_logged_step}
        trainer_state = {"kind": kind, "run_id": self.run_id, "num_agents": self.num_agents, "progress": progress,
                         "config": ckpt.dataclass_to_dict(self.args), "fingerprints": self._fingerprints(),
                         "dataset_size": len(self.train_dataset)}
        metadata = {"version": ckpt.CHECKPOINT_FORMAT, "trainer_class": type(self).__name__,
                    "sequence": self.updates_done, "run_id": self.run_id, "wandb": identity,
                    "comlrl_version": __version__}
        rng_states = self.dist.all_gather_object(ckpt.capture_rng_state())  # every rank's sampling stream
        failure, verdict = None, None
        if self.dist.is_main:
            trainer_state["world_size"] = self.dist.world_size
            try:
                ckpt.save_checkpoint(target, self.agents, self.optimizers, trainer_state, metadata, rng_states)
                ckpt.prune_checkpoints(target.parent, total_limit)
            except Exception as exc:  # every rank must hear of it, or the others would wait forever
                failure, verdict = exc, f"{type(exc).__name__}: {exc}"
        # Also the barrier: nobody moves on (or exits) before the checkpoint is in place.
        verdicts = self.dist.all_gather_object(verdict)
        if failure is not None:
            raise failure
        if verdicts[0] is not None:
            raise ckpt.CheckpointError(
                f"Rank 0 could not write checkpoint {target} ({verdicts[0]}); this rank stops too. Earlier "
                "checkpoints are untouched: fix the cause (disk space, permissions) and resume from the latest.")

    # ============================================================================================
    # Helpers
    # ============================================================================================

    def _epoch_buffers(self) -> List[List[int]]:
        """Dataset positions of each update in an epoch: sequential, as CoMLRL (no shuffling)."""
        n, size = len(self.train_dataset), self.args.rollout_buffer_size
        return [list(range(start, min(start + size, n))) for start in range(0, n, size)]

    def _resolve_devices(self, spec) -> List[torch.device]:
        if spec is None:
            spec = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
        specs = [spec] * self.num_agents if isinstance(spec, str) else list(spec)
        if len(specs) != self.num_agents:
            raise ValueError(f"agent_devices lists {len(specs)} devices for {self.num_agents} agents.")
        return [torch.device(s) for s in specs]

    def _resolve_formatters(self, formatters) -> List[Callable[[dict], str]]:
        def default(item: dict) -> str:
            return item["prompt"]

        if formatters is None:
            return [default] * self.num_agents
        if callable(formatters):
            return [formatters] * self.num_agents
        formatters = list(formatters)
        if len(formatters) != self.num_agents:
            raise ValueError(f"Got {len(formatters)} formatters for {self.num_agents} agents; pass one, or one per agent.")
        return formatters

    def _check_dataset(self, dataset, name: str, required: bool):
        if dataset is None:
            if required:
                raise ValueError(f"{name} is required (a datasets.Dataset whose rows have a 'prompt' field).")
            return None
        if len(dataset) == 0:
            raise ValueError(f"{name} is empty; give it at least one row.")
        first = dataset[0]
        for i, fmt in enumerate(self.formatters):
            try:
                text = fmt(first)
            except KeyError as exc:
                fields = sorted(first) if isinstance(first, dict) else type(first).__name__
                raise ValueError(f"{name} rows have no field {exc} needed by the formatter of agent {i} (fields: {fields}). "
                                 "Rename the column to 'prompt' or pass formatters=[...].") from None
            if not isinstance(text, str):
                raise ValueError(f"The formatter of agent {i} returned {type(text).__name__}, not str, for {name}[0].")
        return dataset

    def _run_config(self) -> Dict[str, Any]:
        return {**ckpt.dataclass_to_dict(self.args), "algorithm": "MAGRPO", "num_agents": self.num_agents,
                "run_id": self.run_id, "comlrl_version": __version__}

    def _summary(self) -> Dict[str, Any]:
        return {"run_id": self.run_id, "env_step": self.env_step, "updates": self.updates_done}

    @contextlib.contextmanager
    def _stop_signals(self):
        """SIGTERM/SIGUSR1/SIGUSR2/SIGINT finish the current update, checkpoint, then stop (exit 75).

        A handler that was installed before (submitit's SIGUSR2 handler requeues the SLURM job) is
        called after the checkpoint is written, so a requeued job continues from it."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {}

        def request_stop(signum, _frame):
            name = signal.Signals(signum).name
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C stops at once
            self._stop_signal = name
            log.warning("%s received: finishing the current update, then checkpointing and stopping.", name)

        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
            previous[sig] = signal.signal(sig, request_stop)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            stopped_by = getattr(signal, self._stop_signal, None) if self._stop_signal else None
            chained = previous.get(stopped_by)
            if callable(chained) and chained is not signal.default_int_handler:
                chained(stopped_by, None)

    def save_model(self, output_dir: str) -> None:
        """HF `save_pretrained` of each agent (and its tokenizer) into output_dir/agent_<i>/ (rank 0)."""
        if not self.dist.is_main:
            return
        for i, agent in enumerate(self.agents):
            target = Path(output_dir) / f"agent_{i}"
            getattr(agent, "module", agent).save_pretrained(target)
            self.tokenizers[i].save_pretrained(target)

    def close(self) -> None:
        self.logger.close()
        if self._rollout_pool is not None:
            self._rollout_pool.shutdown()
            self._rollout_pool = None
        self.dist.close()

