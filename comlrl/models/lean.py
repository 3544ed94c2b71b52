"""Lean decode and training forwards for Llama-family decoder-only models (Llama, Qwen2, Mistral).

Sampling spends most of its time in per-token decode steps. At RL fine-tuning sizes the framework
around each step (module dispatch, mask construction, a KV cache that grows by concatenation) costs
as much as the arithmetic, so decode steps run here as plain tensor code over the model's own
parameters: fused QKV and gate/up projections, a preallocated KV cache and a precomputed additive
mask. The policy-gradient pass (`shared_prompt_logits`) is written the same way, with autograd:
prompt and completion tokens share each projection, and each prompt's keys serve its K samples.
The prompt prefill of sampling runs the same way (`StackedLeanDecoder.prefill`), writing the
prompts' keys and values straight into the decode cache. On the CPU in fp32, sampling for training
also records some of its projections (`ProjectionRecord`), which the policy-gradient pass right
after it reuses instead of multiplying again. These paths compute the model's function (checked
against it in the tests) and are used only for architectures they know; other models run their
own forward.

With a `compute_dtype` (mixed precision), the projections run on bf16 copies of the weights, as
autocast would run them, while norms and rotary embeddings stay in the model's dtype. The decode KV
cache and attention run in bf16 on GPUs (half the cache traffic) but stay in the model's dtype on
the CPU: its bf16 kernels for these tiny per-head products are slower (SDPA measured 490 us vs
80 us for 16 rows x 90 cached tokens), and a bf16 cache with matmul attention gained only ~5% per
step.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from . import onednn, decode_kernels, pages, training_ops

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass
class _Layer:
    """One agent's decoder layer: its projections as `onednn.PackedLinear`s (packed for oneDNN on
    CPUs where it runs that dtype's products, plain weight and bias elsewhere), with each RMSNorm's
    scale folded into the projection that reads the norm's output, and the norms' epsilon."""

    qkv: onednn.PackedLinear
    o: onednn.PackedLinear
    gate_up: onednn.PackedLinear
    down: onednn.PackedLinear
    eps: float


def supports_lean_path(model) -> bool:
    """Whether `model` is an architecture the lean paths reproduce exactly."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu":
        return False
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return False  # sliding-window layers need their own masks
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) and \
            config.model_type == "mistral":
        return False
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "layers") and hasattr(model, "lm_head")


def lean_decoder_for(model, compute_dtype: Optional[torch.dtype] = None,
                     attention_dtype: Optional[torch.dtype] = None) -> Optional["LeanDecoder"]:
    """A LeanDecoder for `model`, or None when its architecture is not one this path reproduces."""
    return LeanDecoder(model, compute_dtype, attention_dtype) if supports_lean_path(model) else None


class LeanDecoder:
    """One agent's decode weights: a snapshot of its current projections (QKV and gate/up fused),
    cast to `compute_dtype` when one is given and, on CPUs where oneDNN runs that dtype's products,
    reordered for it (`onednn.PackedLinear`), one layer at a time so that no second copy of every
    weight is alive at once; where the panel kernel runs them, the parts of each projection as
    views of the parameters (`_FoldedLinear`), copied when `StackedLeanDecoder` packs them. Build
    one per sampling call, right before its `StackedLeanDecoder`, which decodes with one or
    several of them.

    Two rewrites save elementwise passes on every decode step without changing the function:

    * each RMSNorm's scale is folded into the input columns of the projection after it
      (`(w * x) @ W^T = x @ (W diag(w))^T`), so a norm is one call;
    * the query and key rows of each head are reordered so that rotary pairs (i, i + D/2) sit
      next to each other, and the rotation is one complex multiply (`training_ops.rotate_pairs`).
      Queries and keys are permuted alike, so their dot products, and the attention, are
      unchanged; the decode cache holds keys in this order. The training forward does the same.
    """

    @torch.no_grad()  # a snapshot: decoding never needs gradients
    def __init__(self, model, compute_dtype: Optional[torch.dtype] = None,
                 attention_dtype: Optional[torch.dtype] = None):
        inner = model.model
        config = model.config
        self.dtype = inner.embed_tokens.weight.dtype  # residual stream and norms
        self.compute_dtype = compute_dtype or self.dtype  # the projections
        on_cpu = inner.embed_tokens.weight.device.type == "cpu"
        self.attention_dtype = attention_dtype or (self.dtype if on_cpu else self.compute_dtype)  # cache, attention

        low = self.compute_dtype

        def projection(weights: List[torch.Tensor], biases: List[torch.Tensor],
                       norm: Optional[torch.Tensor] = None):
            """The weight parts joined into one projection in the compute dtype, `norm` folded
            into its columns (`training_ops.joined_weight`); for the panel kernel, which packs
            straight from the parts, left unjoined (`_FoldedLinear`)."""
            bias = training_ops.joined_bias(biases, low)
            if weights[0].dtype == low and decode_kernels.runs(weights[0]):
                # fp32 decode products run faster on the panel kernel than packed for oneDNN, where it runs.
                return _FoldedLinear(weights, norm, bias)
            return onednn.PackedLinear(training_ops.joined_weight(weights, low, norm), bias)

        self.num_heads, self.num_kv_heads, self.head_dim = _head_shape(config)
        self.embed = inner.embed_tokens.weight
        self.final_eps = _eps(inner.norm)
        self.lm_head = projection([model.lm_head.weight], _biases(model.lm_head), inner.norm.weight)
        self.rotary = inner.rotary_emb

        self.layers: List[_Layer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                qkv=projection(*_qkv_parts(attn, self.num_heads, self.num_kv_heads, self.head_dim),
                               layer.input_layernorm.weight),
                o=projection([attn.o_proj.weight], _biases(attn.o_proj)),
                gate_up=projection([mlp.gate_proj.weight, mlp.up_proj.weight], _biases(mlp.gate_proj, mlp.up_proj),
                                   layer.post_attention_layernorm.weight),
                down=projection([mlp.down_proj.weight], _biases(mlp.down_proj)),
                eps=_eps(layer.input_layernorm),
            ))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate = self.layers[0].gate_up.out_features // 2


class StackedLeanDecoder:
    """Prefill prompts and decode one token per row against a preallocated KV cache, for one agent
    or several of one architecture at once: every elementwise op and attention call runs once over
    all agents' rows (rows are agent-major, with a leading agent dimension), and each projection is
    one call per agent on its oneDNN-packed weight (CPUs with AVX-512) or one batched matmul over
    the stacked weights (elsewhere; see `_AgentProjections`).

    At RL sizes a decode step costs mostly per-call overhead (a projection of 8-16 rows is ~50 us
    whatever its width), so two agents decode in little more than the time of one. A row computes
    the same whether its agent decodes alone or with others (batched matmuls round per agent alike).
    """

    def __init__(self, decoders: List[LeanDecoder], rows: Optional[int] = None):
        """`rows`: each agent's decode rows (prompts x K), where known: it picks the C kernels'
        panel width (`decode_kernels.panel_width`)."""
        first = decoders[0]
        if any(fusion_signature(d) != fusion_signature(first) for d in decoders):
            raise ValueError("StackedLeanDecoder needs decoders of one architecture, dtype and device.")
        self.count = len(decoders)
        for name in ("dtype", "compute_dtype", "attention_dtype", "num_heads", "num_kv_heads", "head_dim",
                     "q_size", "kv_size", "intermediate", "final_eps", "rotary"):  # rotary: one for all (fusion_signature)
            setattr(self, name, getattr(first, name))
        self.vocab = first.embed.shape[0]
        # Decode attention in one C call per layer where it runs (fp32 cache on the CPU, one thread).
        self.kernel_attention = decode_kernels.runs(first.embed.new_empty(0, dtype=self.attention_dtype))
        # The residual adds, norms and SwiGLU too, where the whole hidden state is fp32 on the CPU.
        self.kernel_elementwise = decode_kernels.runs(first.embed.new_empty(0, dtype=self.compute_dtype)) and \
            self.dtype == torch.float32
        # One agent's embeddings are used as a view; several agents' are concatenated, once per
        # sampling call (see `fuse_decoding` for when stacking agents pays).
        self.embed = torch.cat([d.embed for d in decoders]) if self.count > 1 else first.embed  # row a*vocab+t
        self._token_offsets = torch.zeros(0, dtype=torch.long)
        width = decode_kernels.panel_width(rows)
        self.lm_head = _AgentProjections([d.lm_head for d in decoders], panel_width=width)
        self.layers: List[_StackedLayer] = []
        for index in range(len(first.layers)):
            layers = [d.layers[index] for d in decoders]
            self.layers.append(_StackedLayer(
                qkv=_AgentProjections([layer.qkv for layer in layers], reuse_output=True, panel_width=width),
                o=_AgentProjections([layer.o for layer in layers], reuse_output=True, panel_width=width),
                gate_up=_AgentProjections([layer.gate_up for layer in layers], reuse_output=True, panel_width=width),
                down=_AgentProjections([layer.down for layer in layers], reuse_output=True, panel_width=width),
                eps=layers[0].eps,
            ))
        # Projection records (`ProjectionRecord`) need the panel kernel's outputs and the step's
        # in-place rotation, i.e. the whole step in fp32 C kernels.
        self.can_record = self.kernel_elementwise and self.kernel_attention and all(
            p.panels is not None for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        # A whole step in one C call (`decode_kernels.DecodeStepPlan`) where every part of it runs in
        # the kernels: the same calls in the same order, without ~40 Python calls per step around them.
        self.whole_step_kernel = self.can_record and self.lm_head.panels is not None
        # Each layer's output goes through the next layer's input norm, the last one's the final norm.
        self._eps_after = [layer.eps for layer in self.layers[1:]] + [self.final_eps]

    def _cache(self, prefix_keys, prefix_values, group_size: int, max_new_tokens: int) -> "_DecodeCache":
        """The decode cache around the prompts' keys and values: room for every row's generated tokens.
        It starts zeroed: a fixed-shape step (see `step`) reads every column, and a column not yet
        written must give a finite score for its -inf bias to zero it."""
        prefix = prefix_values[0]
        prompts, heads, _, dim = prefix.shape
        rows = prompts * group_size  # prompts of every agent
        value_shape, key_shape = (rows, heads, max_new_tokens, dim), (rows, heads, dim, max_new_tokens)
        zeros = prefix.new_zeros
        if prefix.device.type == "cpu":  # one zeroed mapping on huge pages (`pages`), freed with the cache
            layer_bytes = 2 * (math.prod(value_shape) * prefix.element_size() + pages.ALIGN)
            arena = pages.Arena(len(prefix_values) * layer_bytes)
            zeros = functools.partial(arena.take, dtype=prefix.dtype)
        values = [zeros(*value_shape) for _ in prefix_values]
        keys = [zeros(*key_shape) for _ in prefix_values]
        return _DecodeCache(prefix_keys, prefix_values, keys, values, group_size)

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                max_new_tokens: int, record: Optional["_StackedRecord"] = None) -> Tuple[torch.Tensor, "_DecodeCache"]:
        """Run every agent's prompts through its layers at once: (logits predicting each prompt's
        next token (agents * prompts, vocab), the decode cache). `prompt_ids`, `prompt_mask`:
        (agents * prompts, width), agent-major, left-padded; positions follow the mask.

        The prompts' keys and values are written straight into the cache's shared prefix (see
        `_DecodeCache`), and only each prompt's last position reaches the LM head. Replaces the
        model's own forward for the prefill, whose per-module overhead cost more than the
        arithmetic at RL prompt sizes (medium tiny model, 2 agents x 2 prompts: ~8 ms per agent).
        With `record`, the layers' projections write into it (see `ProjectionRecord`)."""
        total_prompts, width = prompt_ids.shape
        prompts = total_prompts // self.count
        tokens = total_prompts * width
        group = self.num_heads // self.num_kv_heads
        kv, dim = self.num_kv_heads, self.head_dim
        low, att = self.compute_dtype, self.attention_dtype
        hidden = F.embedding(prompt_ids.reshape(-1) + self._offsets(tokens), self.embed).view(self.count, prompts * width, -1)
        positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        rotation = self.rotary_table(positions)  # (agents * prompts, width, 1, D / 2)
        bias = _prompt_bias(prompt_mask, att)
        scale = dim ** -0.5
        prefix_keys, prefix_values = [], []
        x = self._add_normalize(hidden, None, self.layers[0].eps)
        for index, (layer, next_eps) in enumerate(zip(self.layers, self._eps_after)):
            outs = (None,) * 4 if record is None else record.prompt[index]
            qkv = layer.qkv(_cast(x, low), outs[0]).view(total_prompts, width, -1)
            query_key, value = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            query_key = training_ops.rotate_pairs(query_key.view(total_prompts, width, self.num_heads + kv, dim), rotation)
            if outs[0] is not None:  # a recorded QKV keeps queries and keys rotated, as a decode step leaves them
                qkv[..., : self.q_size + self.kv_size] = query_key.view(total_prompts, width, -1)
            query, key = query_key.to(att).split([self.num_heads, kv], dim=2)
            key = key.permute(0, 2, 3, 1).contiguous()  # (agents * prompts, kv, D, W): the cache's layout
            value = value.view(total_prompts, width, kv, dim).transpose(1, 2).to(att).contiguous()
            prefix_keys.append(key)
            prefix_values.append(value)
            attended = _prompt_attention(query.reshape(total_prompts, width, kv, group, dim), key, value, bias, scale, att)
            columns = width
            if index == len(self.layers) - 1:
                # Past the last layer's attention only each prompt's last position leads anywhere:
                # to the LM head, and (recorded) to the loss's replay, which runs the same rows.
                columns, attended = 1, attended[:, -1:]
                hidden = hidden.view(self.count, prompts, width, -1)[:, :, -1].contiguous()
            x = self._add_normalize(hidden, layer.o(attended.reshape(self.count, prompts * columns, self.q_size).to(low),
                                                    outs[1]), layer.eps)
            x = self._add_normalize(hidden, layer.down(self._swiglu(layer.gate_up(_cast(x, low), outs[2])), outs[3]),
                                    next_eps)
        logits = self.lm_head(_cast(x, low).contiguous(),  # x: (agents, prompts, hidden), final-normed
                              None if record is None else record.logits_prompt).view(total_prompts, -1)
        return logits, self._cache(prefix_keys, prefix_values, group_size, max_new_tokens)

    def attention_bias(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """(rows, 1, 1, total) additive bias from a (rows, total) 0/1 mask: -inf at left padding."""
        bias = torch.zeros(attention_mask.shape, dtype=self.attention_dtype, device=attention_mask.device)
        return bias.masked_fill_(attention_mask == 0, float("-inf")).view(attention_mask.shape[0], 1, 1, -1)

    def rotary_table(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotations (rows, steps, 1, head_dim / 2), complex, for `positions` (rows, steps):
        computed once per sampling call and sliced per step (the rotary module costs as much as a
        layer's elementwise work when called per token). See `training_ops.rotate_pairs`."""
        return _rotation_table(self.rotary, self.embed, positions)

    def _offsets(self, rows: int) -> torch.Tensor:
        """Per row, its agent's first row in the concatenated embeddings (rows are agent-major)."""
        if self._token_offsets.shape[0] != rows:
            agent = torch.arange(self.count, device=self.embed.device).repeat_interleave(rows // self.count)
            self._token_offsets = agent * self.vocab
        return self._token_offsets

    def step(self, tokens: torch.Tensor, rotation: torch.Tensor, cache: "_DecodeCache",
             steps_done: Union[int, torch.Tensor], attention_bias: torch.Tensor,
             record: Optional["_StackedRecord"] = None) -> torch.Tensor:
        """Logits (agents * rows, vocab) for `tokens` (agents * rows,), agent-major, whose rotations
        are a (rows, 1, head_dim / 2) slice of `rotary_table`; writes their K/V at column
        `steps_done` of the generated part of the cache. `attention_bias` (from `attention_bias`, over
        prompt width + max_new_tokens columns) is -inf at left padding.

        `steps_done` as a one-element tensor on the device makes the step's shapes fixed, for CUDA
        graph replay (`rollout`): the K/V are written at that column by `index_copy_`, attention
        reads every column of the cache, and `attention_bias` must also be -inf past `steps_done`
        (columns not yet written).

        Attention for one query token runs as small batched matmuls in two parts. Against the prompt
        prefix, the query heads of a prompt's K samples are the rows of one product per prompt and
        KV head, so the prefix is read once per prompt, not once per sample (at RL prompt lengths it
        is most of the cache). Against its own generated tokens, each row has its own product. One
        softmax spans both parts. Keys are stored transposed, so no product copies its operands, and
        grouped-query heads are rows of their KV head's product (no repeat of keys or values).
        Measured on the CPU (L benchmark shapes): SDPA over a per-row cache 3.9 ms per step, per-row
        matmul attention 3.0 ms, this ~2.2 ms. With an fp32 cache on the CPU the same attention runs as
        one C call per layer (`decode_kernels.attention`), in place of ~40 small torch ops; where the
        whole step is fp32 there, so do the rotary embedding with the K/V write, each residual add
        with the norm after it, and SwiGLU; and where every projection also runs on panels
        (`whole_step_kernel`), the whole step is one C call on a plan built at its first step
        (`decode_kernels.DecodeStepPlan`, bitwise the per-kernel calls). With `record` (only there, with an int `steps_done`),
        the layers' projections write into it (see `ProjectionRecord`)."""
        total = tokens.shape[0]
        rows = total // self.count
        fixed_shape = torch.is_tensor(steps_done)
        logits_out = None if record is None else record.step_logits(steps_done)
        if self.whole_step_kernel and not fixed_shape:
            return self._step_plan(cache, attention_bias, rows, record)(tokens, rotation, steps_done, logits_out)
        width = cache.prefix_keys[0].shape[-1]
        hidden = F.embedding(tokens + self._offsets(total), self.embed).view(self.count, rows, -1)  # (A, rows, hidden)
        columns = cache.keys[0].shape[-1] if fixed_shape else steps_done + 1  # generated columns attended
        bias = attention_bias[..., : width + columns]
        scale = self.head_dim ** -0.5
        low = self.compute_dtype
        x = self._add_normalize(hidden, None, self.layers[0].eps)
        for index, (layer, next_eps) in enumerate(zip(self.layers, self._eps_after)):
            outs = (None,) * 4 if record is None else [None if b is None else b[steps_done] for b in record.steps[index]]
            qkv = layer.qkv(_cast(x, low), outs[0]).view(total, -1)
            keys, values = cache.keys[index], cache.values[index]
            if self.kernel_elementwise and self.kernel_attention and not fixed_shape:
                query_key = decode_kernels.rotate_into_cache(qkv, rotation, self.num_heads, keys, values, steps_done)
            else:
                query_key = qkv[:, : self.q_size + self.kv_size].view(total, self.num_heads + self.num_kv_heads,
                                                                       self.head_dim)
                query_key = training_ops.rotate_pairs(query_key, rotation)
                new_keys = query_key[:, self.num_heads:]
                new_values = qkv[:, self.q_size + self.kv_size:].view(total, self.num_kv_heads, self.head_dim)
                if fixed_shape:
                    keys.index_copy_(3, steps_done, new_keys.unsqueeze(-1).to(keys.dtype))
                    values.index_copy_(2, steps_done, new_values.unsqueeze(2).to(values.dtype))
                else:
                    keys[:, :, :, steps_done] = new_keys
                    values[:, :, steps_done] = new_values
            if self.kernel_attention and not fixed_shape:  # one C call (fp32 on the CPU)
                attended = decode_kernels.attention(query_key, self.num_heads, cache.group_size, cache.prefix_keys[index],
                                                    cache.prefix_values[index], keys, values, columns,
                                                    attention_bias, scale)
            else:
                attended = self._attention(query_key, cache, index, columns, bias, scale)
            x = self._add_normalize(hidden, layer.o(_cast(attended.view(self.count, rows, self.q_size), low), outs[1]),
                                    layer.eps)
            x = self._add_normalize(hidden, layer.down(self._swiglu(layer.gate_up(_cast(x, low), outs[2])), outs[3]),
                                    next_eps)
        return self.lm_head(_cast(x, low), logits_out).view(total, -1)

    def _step_plan(self, cache: "_DecodeCache", attention_bias: torch.Tensor, rows: int,
                   record: Optional["_StackedRecord"]) -> decode_kernels.DecodeStepPlan:
        """The cache's whole-step plan for these rows, bias and record, built on its first step."""
        key = (rows, attention_bias.data_ptr(), id(record))
        if cache.step_plan is None or cache.step_plan_key != key:
            layers = []
            for index, (layer, next_eps) in enumerate(zip(self.layers, self._eps_after)):
                records = (None,) * 4 if record is None else record.steps[index]
                layers.append(((layer.qkv.panels, layer.o.panels, layer.gate_up.panels, layer.down.panels),
                               cache.prefix_keys[index], cache.prefix_values[index], cache.keys[index],
                               cache.values[index], layer.eps, next_eps, records))
            cache.step_plan = decode_kernels.DecodeStepPlan(
                agents=self.count, rows=rows, heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                group_size=cache.group_size, embed=self.embed, head=self.lm_head.panels,
                attention_bias=attention_bias, first_eps=self.layers[0].eps, layers=layers)
            cache.step_plan_key = key
        return cache.step_plan

    def _add_normalize(self, hidden: torch.Tensor, delta: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        """The residual add and the norm after it (prefill and step): `hidden += delta` in place (their
        hidden state is their own tensor), then `_normalize(hidden)`; one C call where the kernels run."""
        if self.kernel_elementwise:
            return decode_kernels.residual_rms_norm(hidden, delta, eps)
        if delta is not None:
            hidden.add_(delta)
        return _normalize(hidden, eps)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gate/up projection's output; one C call where the kernels run."""
        if self.kernel_elementwise:
            return decode_kernels.silu_mul(gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate) * up

    def _attention(self, query_key: torch.Tensor, cache: "_DecodeCache", index: int, columns: int,
                   bias: torch.Tensor, scale: float) -> torch.Tensor:
        """`step`'s attention in torch ops, (rows, heads * head_dim) in the attention dtype: `query_key`
        (rows, heads + kv heads, head_dim) rotated, this step's keys and values already in the cache
        (the first `columns` generated columns are attended), `bias` sliced to those columns."""
        total = query_key.shape[0]
        group = self.num_heads // self.num_kv_heads
        prompts = total // cache.group_size
        width = cache.prefix_keys[index].shape[-1]
        shared_rows = cache.group_size * group  # rows of one prompt's product per KV head
        keys, values = cache.keys[index], cache.values[index]
        q = _cast(query_key[:, : self.num_heads].reshape(total, self.num_kv_heads, group, self.head_dim),
                  self.attention_dtype)
        # (prompts, K, kv, group, D) -> (prompts, kv, K * group, D): one product per prompt and KV head
        q_shared = q.view(prompts, cache.group_size, self.num_kv_heads, group, self.head_dim).transpose(1, 2)
        prefix_scores = torch.matmul(q_shared.reshape(prompts, self.num_kv_heads, shared_rows, self.head_dim),
                                     cache.prefix_keys[index])
        prefix_scores = prefix_scores.view(prompts, self.num_kv_heads, cache.group_size, group, width).transpose(1, 2)
        own_scores = torch.matmul(q, keys[..., :columns])  # (total, kv, group, columns)
        scores = torch.cat([prefix_scores.reshape(total, self.num_kv_heads, group, width), own_scores], dim=-1)
        probs = _cast(torch.add(bias, scores, alpha=scale).softmax(dim=-1, dtype=torch.float32), self.attention_dtype)
        prefix_probs = probs[..., :width].reshape(prompts, cache.group_size, self.num_kv_heads, group, width)
        prefix_part = torch.matmul(prefix_probs.transpose(1, 2).reshape(prompts, self.num_kv_heads, shared_rows, width),
                                   cache.prefix_values[index])
        prefix_part = prefix_part.view(prompts, self.num_kv_heads, cache.group_size, group, self.head_dim).transpose(1, 2)
        attended = torch.matmul(probs[..., width:], values[:, :, :columns]).view(
            prompts, cache.group_size, self.num_kv_heads, group, self.head_dim) + prefix_part
        return attended.reshape(total, self.q_size)

@dataclass
class _DecodeCache:
    """Per layer: the prompts' keys (prompts, kv, D, width) and values (prompts, kv, width, D), shared
    by each prompt's `group_size` rows, and every row's generated keys (rows, kv, D, max_new) and
    values (rows, kv, max_new, D). Keys are stored transposed."""

    prefix_keys: List[torch.Tensor]
    prefix_values: List[torch.Tensor]
    keys: List[torch.Tensor]
    values: List[torch.Tensor]
    group_size: int
    # `StackedLeanDecoder.step`'s whole-step plan (`decode_kernels.DecodeStepPlan`) and what it was
    # built for (rows, bias, record), where the step runs as one C call.
    step_plan: Optional[decode_kernels.DecodeStepPlan] = None
    step_plan_key: Optional[tuple] = None


#: Whether sampling records projections for the policy-gradient pass to reuse (`ProjectionRecord`);
#: COMLRL_REUSE_SAMPLING_PROJECTIONS=0 turns it off (the loss forward then multiplies again).
REUSE_SAMPLING_PROJECTIONS = os.environ.get("COMLRL_REUSE_SAMPLING_PROJECTIONS", "1") != "0"

#: A layer's projections, in the order `ProjectionRecord` and `training_ops.Replayed` lists use.
PROJECTIONS = ("qkv", "o", "gate_up", "down")

#: The projections sampling records. Each recorded one costs memory from the sampling call to the
#: update and saves its product in the loss forward. Measured on an AVX2 EPYC (fp32; gradient
#: buffers allocated up front, see `magrpo._GradientBuffers`), the S-medium benchmark's peak
#: RSS (CoMLRL's: 608-612 MB): gate/up and down 598-601 MB; with the output projection too, the
#: same, and `profile.py`'s L forward phase 1.86 -> 1.58 s; all four 609-611 MB, over budget then.
#: The fused training attention (`training_ops.shared_prefix_attention`) then kept ~10 MB less
#: (S-medium 591-594 MB with three recorded), so QKV is recorded too: S-medium 601-603 MB and
#: ~6% faster (interleaved runs), L's forward phase 1.69 -> 1.21 s (L 630 -> 650 MB; CoMLRL's
#: ~690). Recording QKV and down instead of gate/up and down made L 0.9 s slower: gate/up, the
#: widest output, saves the most after down (twice the inputs per output of the others).
RECORDED_PROJECTIONS = PROJECTIONS


def last_column_only(layer: int, layers: int, projection: str) -> bool:
    """Whether a record holds, and a replay reads, only each prompt's last column of `projection`
    (a name in `PROJECTIONS`) in layer `layer` of `layers`: the last layer's projections after its
    attention, which the prefill and the loss forward run on those rows alone (`lm_head_rows`)."""
    return layer == layers - 1 and projection != "qkv"


class ProjectionRecord:
    """One agent's layer projections as a sampling call computed them, for the policy-gradient pass
    right after it to reuse instead of multiplying again (`shared_prompt_logits`' `replayed`).

    In MAGRPO's usual setting (one minibatch per rollout buffer) the loss forward runs the very
    products, of the very parameters, that sampling just ran: its prompt tokens went through the
    prefill and every completion token through a decode step. So the decode writes the
    `RECORDED_PROJECTIONS` of each layer into this record (no copy: the C panel kernel writes there,
    see `StackedLeanDecoder.step`) and the loss forward takes them as those products' results
    (`training_ops.Replayed`). Everything else runs as before (embeddings, norms, rotary, attention,
    the other projections, the LM head), and the backward pass is the same, at the activations the
    replayed forward computed (equal to the sampling pass's to float rounding).

    Valid only while the parameters are those that sampled: the trainer drops an agent's record at
    its first optimizer step (`release`). Recorded where the whole decode step runs in fp32 C kernels
    on the CPU (`StackedLeanDecoder.can_record`), which rotate queries and keys in place: the record
    holds them rotated, prompt and steps alike, and the replayed rotary only rotates gradients.

    `prompt`: per layer, per projection (`PROJECTIONS`) its (prompts, width, features) outputs for
    the prompts as the sampling call padded them (the last layer's projections after its attention:
    (prompts, 1, features), each prompt's last column, see `lm_head_rows`), or None where not
    recorded; `steps`: the same,
    (max_new, rows, features), step t holding completion token t's (rows prompt-major,
    `group_size` per prompt; steps a row ran after its EOS hold its padding's). `logits`, where the
    LM head ran on the panel kernel: (the prefill's (prompts, vocab), the steps' (max_new, rows,
    vocab)), the logits sampling drew each token from, which are the loss's logits: the LM head's
    product need not run again either (one (rows, 256) x (256, 257) product per L loss chunk)."""

    def __init__(self, prompt: List[Tuple[Optional[torch.Tensor], ...]], steps: List[Tuple[Optional[torch.Tensor], ...]],
                 group_size: int, owner: Optional["_StackedRecord"] = None,
                 logits: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        self.prompt, self.steps, self.group_size, self.logits = prompt, steps, group_size, logits
        self._owner = owner

    def replayed(self, nodes: List[int], first_column: int, steps: int) -> List[Tuple[Optional["training_ops.Replayed"], ...]]:
        """Per layer, per projection, what `shared_prompt_logits` takes for `nodes`' prompts (from
        column `first_column`) and their completions' first `steps` tokens, in its token order:
        every prompt's tokens, then every row's (rows prompt-major); for the last layer's
        projections after its attention, only each prompt's last column of its tokens (see
        `lm_head_rows`). None for a projection not recorded. Where the logits were recorded, one
        more entry after the layers: (the LM head's outputs,), in the order `shared_prompt_logits`
        feeds it, row by row its prompt's last position, then its first `steps` tokens. Each is
        gathered when the forward reaches it."""
        def part(layer: int, name: str, prompt: torch.Tensor, step: torch.Tensor) -> "training_ops.Replayed":
            first = 0 if last_column_only(layer, len(self.prompt), name) else first_column
            return training_ops.Replayed(functools.partial(self._gather, prompt, step, nodes, first, steps),
                                         functools.partial(self._row_addresses, prompt, step, nodes, first, steps))

        layers = [tuple(None if prompt is None else part(layer, name, prompt, step)
                        for name, prompt, step in zip(PROJECTIONS, prompt_parts, step_parts))
                  for layer, (prompt_parts, step_parts) in enumerate(zip(self.prompt, self.steps))]
        if self.logits is not None:
            layers.append((training_ops.Replayed(functools.partial(self._gather_logits, nodes, steps)),))
        return layers

    def _gather_logits(self, nodes: List[int], steps: int) -> torch.Tensor:
        prompt, step = self.logits
        k, vocab = self.group_size, prompt.shape[-1]
        joined = prompt.new_empty(len(nodes), k, steps + 1, vocab)
        for i, node in enumerate(nodes):  # the prompt's last position serves its K rows
            joined[i, :, 0] = prompt[node]
            joined[i, :, 1:].copy_(step[:steps, node * k:(node + 1) * k].transpose(0, 1))
        return joined.view(-1, vocab)

    def _row_addresses(self, prompt: torch.Tensor, step: torch.Tensor, nodes: List[int], first_column: int,
                       steps: int) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Where `_gather`'s rows lie in the record, in its order: (int64 addresses, (prompt, step))."""
        k, size = self.group_size, prompt.element_size()
        node = torch.tensor(nodes, dtype=torch.int64)
        columns = torch.arange(first_column, prompt.shape[1], dtype=torch.int64)
        prompt_rows = (node[:, None] * prompt.stride(0) + columns * prompt.stride(1)).reshape(-1)
        completion_rows = ((node[:, None, None] * k + torch.arange(k)[:, None]) * step.stride(1)
                           + torch.arange(steps) * step.stride(0)).reshape(-1)
        return torch.cat([prompt.data_ptr() + prompt_rows * size, step.data_ptr() + completion_rows * size]), (prompt, step)

    def _gather(self, prompt: torch.Tensor, step: torch.Tensor, nodes: List[int], first_column: int,
                steps: int) -> torch.Tensor:
        k = self.group_size
        width, features = prompt.shape[1] - first_column, prompt.shape[-1]
        joined = prompt.new_empty(len(nodes) * (width + k * steps), features)
        prompt_part = joined[: len(nodes) * width].view(len(nodes), width, features)
        row_part = joined[len(nodes) * width:].view(len(nodes), k, steps, features)
        for i, node in enumerate(nodes):  # one copy per node and part (its K rows are adjacent)
            prompt_part[i].copy_(prompt[node, first_column:])
            row_part[i].copy_(step[:steps, node * k:(node + 1) * k].transpose(0, 1))
        return joined

    def release(self) -> None:
        """Done with this record: once every agent of its sampling call has released its record,
        their step buffers serve the next sampling call of the same shape (fresh ones cost a page
        fault per 4 KB on first write, ~6 ms per S-medium sampling call). Do not read it after."""
        owner, self._owner = self._owner, None
        self.prompt = self.steps = []
        self.logits = None
        if owner is not None:
            owner.released()


class _StackedRecord:
    """The ProjectionRecords of a StackedLeanDecoder's agents while it decodes: per layer, per
    projection (`PROJECTIONS`; None where not in `projections`), `prompt` holds the
    prefill's (agents, prompts * width, features) outputs (for the last layer's projections after
    its attention, (agents, prompts, features): each prompt's last column, all the prefill runs
    there) and `steps` the steps' (max_new, agents, rows, features), step t's slice contiguous for
    the panel kernel to write into."""

    # Step buffers of released records, by shape. A list per shape: agents that decode apart hold
    # one record each at once, and each should find its buffers again in the next sampling call.
    _spare_steps: Dict[tuple, List[list]] = {}
    _lock = threading.Lock()

    def __init__(self, decoder: "StackedLeanDecoder", prompts: int, width: int, rows: int, max_new_tokens: int,
                 projections: Sequence[str] = RECORDED_PROJECTIONS):
        layer = decoder.layers[0]
        features = [p.panels.out_features if name in projections else None
                    for name, p in zip(PROJECTIONS, (layer.qkv, layer.o, layer.gate_up, layer.down))]
        agents = self.agents = decoder.count
        layers = len(decoder.layers)
        self.prompt = [tuple(None if n is None else
                             torch.empty(agents, prompts * (1 if last_column_only(index, layers, name) else width), n)
                             for name, n in zip(PROJECTIONS, features))
                       for index in range(layers)]
        # The LM head's logits too, where it runs on the panel kernel: the prefill's (agents, prompts,
        # vocab) and the steps' (max_new, agents, rows, vocab), which the steps write and sample from.
        vocab = None if decoder.lm_head.panels is None else decoder.lm_head.panels.out_features
        self.logits_prompt = None if vocab is None else torch.empty(agents, prompts, vocab)
        self._key = (agents, rows, max_new_tokens, len(decoder.layers), tuple(features), vocab)
        with self._lock:
            spares = self._spare_steps.get(self._key)
            self.steps, self.logits_steps = spares.pop() if spares else (None, None)
        if self.steps is None:
            # One arena on huge pages (`pages`) for a shape's step buffers, kept for reuse once
            # released: each decode step writes its slice of them first, and on 4 KiB pages that first
            # write faulted page by page (L benchmark: 67 MB, the first sampling call of a run ~447 ms
            # against ~260 for the calls after it, ~330 without records). Alternating processes on an
            # AVX2 EPYC, that first call (4 each): 286-466 -> 245-353 ms; peak RSS +2.5 MB (S-medium).
            widths = [n for n in features if n is not None] * layers + ([vocab] if vocab is not None else [])
            fp32 = torch.float32.itemsize  # records exist only where the whole step runs in fp32
            arena = pages.Arena(sum(max_new_tokens * agents * rows * n * fp32 + pages.ALIGN for n in widths))
            take = functools.partial(arena.take, max_new_tokens, agents, rows)
            self.steps = [tuple(None if n is None else take(n) for n in features) for _ in decoder.layers]
            self.logits_steps = None if vocab is None else take(vocab)
        self._unreleased = agents

    def split(self, prompts: int, group_size: int) -> List[ProjectionRecord]:
        """One ProjectionRecord per agent (views)."""
        return [ProjectionRecord(
            [tuple(None if t is None else t[a].view(prompts, -1, t.shape[-1]) for t in layer) for layer in self.prompt],
            [tuple(None if t is None else t[:, a] for t in layer) for layer in self.steps], group_size, self,
            None if self.logits_prompt is None else (self.logits_prompt[a], self.logits_steps[:, a]))
            for a in range(self.agents)]

    def step_logits(self, step: int) -> Optional[torch.Tensor]:
        """Where decode step `step` writes its logits, (agents, rows, vocab); None if not recorded."""
        return None if self.logits_steps is None else self.logits_steps[step]

    def released(self) -> None:
        with self._lock:
            self._unreleased -= 1
            if self._unreleased == 0:  # kept for the next record of this shape (a run samples with one)
                self._spare_steps.setdefault(self._key, []).append((self.steps, self.logits_steps))


#: Agents with more parameters than this decode one by one instead of as one stacked batch.
FUSE_MAX_PARAMETERS = 50_000_000
#: The same limit for agents on the CPU, where a fused step reads every agent's weights: past a few
#: MB each, the agents' weights together no longer stay in the shared cache from one step to the
#: next, and decoding them one after the other is faster.
FUSE_MAX_PARAMETERS_CPU = 1_000_000


def fuse_decoding(model) -> bool:
    """Whether agents like `model` should decode as one stacked batch. Stacking copies weights once
    per sampling call (every projection off the CPU, where they are stacked for batched matmuls; the
    embeddings everywhere) and saves per-call overhead on every step: a clear gain for small models,
    whose decode steps are bound by per-call costs, and a loss for large ones, whose steps are bound
    by reading the weights (copying one Qwen2.5-0.5B-shaped agent's weights took ~0.8 s per sampling
    call on the CPU). On the CPU the line is lower (`FUSE_MAX_PARAMETERS_CPU`): on a 2-core Zen 3
    with 32 MB of shared L3, two medium tiny agents (2.4 M parameters each, 16 rows per agent)
    decoded apart took 7-13% less time per step than stacked; two small ones (0.1 M) took ~30%
    more per sampling call, bound by per-call costs."""
    parameters = list(model.parameters())
    limit = FUSE_MAX_PARAMETERS_CPU if parameters and parameters[0].device.type == "cpu" else FUSE_MAX_PARAMETERS
    return sum(p.numel() for p in parameters) <= limit


def fusion_signature(decoder: LeanDecoder) -> tuple:
    """What agents must share to decode as one StackedLeanDecoder: every shape, dtype, epsilon and
    rotary table (so that one rotary module serves all) and the device."""
    def shape(t):
        return None if t is None else (tuple(t.shape), t.dtype, t.device)

    def projection(p):
        weight = (p.weight_signature if isinstance(p, _FoldedLinear) else shape(p.weight))
        return weight, shape(p.bias), p.packed

    layer_shapes = tuple((projection(l.qkv), projection(l.o), projection(l.gate_up), projection(l.down), l.eps)
                         for l in decoder.layers)
    rotary = decoder.rotary
    inv_freq = getattr(rotary, "inv_freq", None)
    return (decoder.dtype, decoder.compute_dtype, decoder.attention_dtype, decoder.num_heads, decoder.num_kv_heads,
            decoder.head_dim, shape(decoder.embed), projection(decoder.lm_head),
            decoder.final_eps, layer_shapes, type(rotary).__name__, getattr(rotary, "attention_scaling", None),
            None if inv_freq is None else tuple(inv_freq.tolist()))


def shared_prompt_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                         group_size: int, compute_dtype: Optional[torch.dtype] = None,
                         replayed: Optional[List[Tuple["training_ops.Replayed", ...]]] = None) -> Optional[torch.Tensor]:
    """Logits (rows, T, vocab), in fp32, predicting each token of `completion_ids` (rows, T; rows
    group-major, `group_size` per prompt) after its prompt (`prompt_ids` (prompts, P), left-padded
    as `prompt_mask` says), with gradients to the model's parameters; None when the model is not
    an architecture this path reproduces (or uses attention dropout while training), or is not on
    the CPU.

    The attention here keeps its probabilities for the backward pass, as eager attention does. On
    the CPU the loss chunks (~1024 tokens) keep that small, and it is faster than the transformers
    forward there; GPUs keep the model's own forward, whose fused SDPA kernels store no
    probabilities at the 64k-token chunks GPUs use.

    The same function as the transformers forward that `generate` runs (positions follow the
    attention mask), written for the policy-gradient pass:

    * prompt and completion tokens go through each layer together, so every projection is one
      matmul per layer (fused QKV and gate/up weights), not one per forward;
    * each prompt's keys and values are computed once and read by its K completions in a
      shared-prefix product, so nothing is repeated per sample, forward or backward;
    * only the prompt's last position and the completion positions go on past the last layer's
      attention to its output projection and MLP, and to the LM head (`lm_head_rows`);
    * with `compute_dtype`, projections and attention products run in bf16 (each weight cast
      once per pass); norms, rotary embeddings, softmax and the residual stream stay in the
      model's dtype, as under autocast;
    * the backward pass keeps no copy of a weight nor the inputs it can recompute cheaply
      (`training_ops.norm_linear`, `training_ops.swiglu_linear`);
    * in fp32 where the C kernels run, the attention is one autograd node whose softmax, masks and
      softmax backward are C passes over the scores in place (`training_ops.shared_prefix_attention`;
      elsewhere `_composed_attention`, the same products from torch ops);
    * with `replayed` (`ProjectionRecord.replayed` for these tokens, made with these parameters),
      the layers' projections, and where recorded the LM head's logits, are not multiplied again
      but taken from the sampling pass.
    """
    if (not supports_lean_path(model) or prompt_ids.device.type != "cpu"
            or (model.training and getattr(model.config, "attention_dropout", 0.0))):
        return None
    inner = model.model
    dtype = inner.embed_tokens.weight.dtype
    low = compute_dtype or dtype
    heads, kv_heads, head_dim = _head_shape(model.config)
    prompts, width = prompt_ids.shape
    rows, steps = completion_ids.shape[0], completion_ids.shape[1] - 1  # the last token is only predicted
    k = group_size
    prompt_tokens = prompts * width
    device = prompt_ids.device

    # Positions follow the mask (left padding gets 0); completion j sits at last prompt position + 1 + j.
    prompt_positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    completion_positions = prompt_positions[:, -1:] + 1 + torch.arange(steps, device=device)
    positions = torch.cat([prompt_positions.reshape(-1),
                           completion_positions.repeat_interleave(k, dim=0).reshape(-1)])
    rotation = _rotation_table(inner.rotary_emb, inner.embed_tokens.weight, positions.unsqueeze(0))[0]  # (tokens, 1, D / 2)

    # Additive masks. Prompt: see `_prompt_bias`. Completion: its prompt's real tokens, then causal
    # over itself (the fused attention's kernel applies the causal part itself).
    blocked = float("-inf")
    real = prompt_mask.bool()
    prompt_bias = _prompt_bias(prompt_mask, dtype)
    attention_shape = training_ops.AttentionShape(prompts, width, k, steps, heads, kv_heads, head_dim)
    fused_attention = low == torch.float32 and decode_kernels.runs(prompt_bias)
    if fused_attention:
        fused_prompt_bias = prompt_bias.view(prompts, width, width)
        fused_prefix_bias = torch.zeros(prompts, 1, width, dtype=dtype, device=device).masked_fill_(
            ~real[:, None, :], blocked)
    else:
        completion_bias = torch.zeros(prompts, steps, width + steps, dtype=dtype, device=device)
        completion_bias[:, :, :width].masked_fill_(~real[:, None, :], blocked)
        completion_bias[:, :, width:].masked_fill_(
            ~torch.ones(steps, steps, dtype=torch.bool, device=device).tril(), blocked)
        completion_bias = completion_bias[:, None, None, None]  # (prompts, 1, 1, 1, S, P + S) over (kv, K, group)

    hidden = F.embedding(torch.cat([prompt_ids.reshape(-1), completion_ids[:, :steps].reshape(-1)]),
                         inner.embed_tokens.weight)
    scale = head_dim ** -0.5
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    for index, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        known_qkv, known_o, known_gate_up, known_down = (None,) * 4 if replayed is None else replayed[index]
        qkv_weights, qkv_biases = _qkv_parts(attn, heads, kv_heads, head_dim)
        qkv = training_ops.norm_linear(hidden, layer.input_layernorm.weight, _eps(layer.input_layernorm),
                                       qkv_weights, qkv_biases, low, known_qkv)
        # Splits, not pairs of slices: a split's backward is one concatenation, while each slice's
        # backward fills a zero tensor of the whole input's size.
        query_key, value = qkv.split([q_size + kv_size, kv_size], dim=-1)
        query_key = training_ops.rotary(query_key.view(-1, heads + kv_heads, head_dim), rotation, low,
                                        already_rotated=known_qkv is not None)
        value = value.view(-1, kv_heads, head_dim)
        if fused_attention:
            attended = training_ops.shared_prefix_attention(query_key, value, fused_prompt_bias, fused_prefix_bias,
                                                            attention_shape, scale)
        else:
            attended = _composed_attention(query_key, value, attention_shape, prompt_bias, completion_bias, scale, low)
        if index == len(inner.layers) - 1:  # from here on only the rows the LM head reads
            hidden, attended = lm_head_rows(hidden, prompts, width), lm_head_rows(attended, prompts, width)
        hidden = hidden + training_ops.linear(attended, [attn.o_proj.weight], _biases(attn.o_proj), low, known_o)
        # With gate/up and down both replayed, the forward reads no gate/up output: SwiGLU's
        # backward takes it from the record, so it is not kept from the forward pass.
        defer = known_gate_up is not None and known_down is not None
        gate_up = training_ops.norm_linear(hidden, layer.post_attention_layernorm.weight,
                                           _eps(layer.post_attention_layernorm),
                                           [mlp.gate_proj.weight, mlp.up_proj.weight], _biases(mlp.gate_proj, mlp.up_proj),
                                           low, known_gate_up, defer=defer)
        hidden = hidden + training_ops.swiglu_linear(gate_up, mlp.down_proj.weight, mlp.down_proj.bias, low, known_down,
                                                     replayed_input=known_gate_up if defer else None)

    # The prompt's last position predicts each completion's first token; completion j predicts j + 1.
    last, completion_hidden = hidden.split([prompts, rows * steps])
    last = last.repeat_interleave(k, dim=0)
    outputs = torch.cat([last.unsqueeze(1), completion_hidden.view(rows, steps, hidden.shape[-1])], dim=1)
    known_logits = replayed[len(inner.layers)][0] if replayed is not None and len(replayed) > len(inner.layers) else None
    return training_ops.norm_linear(outputs, inner.norm.weight, _eps(inner.norm), [model.lm_head.weight],
                                    _biases(model.lm_head), low, known_logits).float()


def lm_head_rows(tokens: torch.Tensor, prompts: int, width: int) -> torch.Tensor:
    """`shared_prompt_logits`' token rows (every prompt's `width` tokens, then the completions')
    less the prompt tokens before each prompt's last. Past the last layer's attention those rows
    lead only to logits for prompt tokens, which no loss reads (the completions need the prompt's
    keys and values, computed before), so the last layer's output projection and MLP, forward and
    backward, skip them: the prompt's ~50-100 tokens of a loss chunk's ~550-600."""
    prompt_part, completion_part = tokens.split([prompts * width, tokens.shape[0] - prompts * width])
    return torch.cat([prompt_part.view(prompts, width, -1)[:, -1].reshape(prompts, *tokens.shape[1:]), completion_part])


class _FoldedLinear:
    """A projection for the panel kernel, unjoined: its weight parts (views of the parameters, rows
    in order) and the RMSNorm weight folded into its columns, which `decode_kernels.PanelWeights`
    packs in one pass (joining them first cost a copy of the QKV, gate/up and LM head weights per
    sampling call; two medium agents, AVX2 EPYC: building the decoders 6.6-8.9 -> 2.4-3.5 ms, the
    packing about as before, ~13-18 -> ~10-12 ms together). `weight`, the joined one, is made only
    if asked for."""

    packed = False

    def __init__(self, parts: List[torch.Tensor], norm: Optional[torch.Tensor], bias: Optional[torch.Tensor]):
        self.parts, self.norm, self.bias = list(parts), norm, bias
        self.in_features = parts[0].shape[-1]
        self.out_features = sum(p.numel() for p in parts) // self.in_features
        self._weight: Optional[torch.Tensor] = None

    @property
    def weight_signature(self) -> tuple:
        """`fusion_signature`'s entry for the joined weight, without joining it."""
        first = self.parts[0]
        return (self.out_features, self.in_features), first.dtype, first.device

    @property
    def weight(self) -> torch.Tensor:
        if self._weight is None:
            self._weight = training_ops.joined_weight(self.parts, self.parts[0].dtype, self.norm)
        return self._weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _AgentProjections:
    """One projection (QKV, output, gate/up, down or LM head) of every agent of a
    StackedLeanDecoder: (A, rows, in) -> (A, rows, out), agent a's rows through agent a's weight.

    fp32 weights on the CPU with one torch thread go to the C panel kernel (`decode_kernels`),
    packed once per sampling call, one call for all agents. Where oneDNN packs the weights instead
    (bf16 on CPUs with native bf16, fp32 on AMD CPUs with AVX-512 when the kernel does not run; see
    `onednn`), a decode step makes one call per agent: at decode sizes (8-32 rows) that beats one
    batched matmul over stacked weights, which reorders the weights (bf16) or runs MKL's AVX2 code
    (fp32) on every step (medium tiny model, 2 agents x 16 rows, one step's projections on an
    AVX-512 EPYC: bf16 1.40 -> 0.92 ms, fp32 3.39 -> 1.90 ms). Otherwise the weights are stacked on
    a leading agent dimension for one batched matmul per step: on an AVX2-only CPU that beats one
    MKL call per agent (2 x 16 rows, 256 -> 768: 240 against 274 us). Off the CPU one agent's
    weight is used as a view."""

    def __init__(self, projections: List[onednn.PackedLinear], reuse_output: bool = False,
                 panel_width: Optional[int] = None):
        self.packed = all(p.packed for p in projections)
        # With `reuse_output`, the panel kernel writes every call into one buffer (replaced when the
        # row count changes, e.g. from the prefill's to the steps'), overwritten by the next call:
        # for the layers' projections, whose outputs the prefill and each decode step consume before
        # the same projection runs again (not the LM head's logits, which they return). A fresh
        # (A, rows, out) tensor per call cost ~15 us of a ~70 us call.
        self._reuse_output = reuse_output
        self._output: Optional[torch.Tensor] = None
        self.panels: Optional[decode_kernels.PanelWeights] = None
        if self.packed:
            self.linears = projections
            return
        biases = [p.bias for p in projections]
        if all(isinstance(p, _FoldedLinear) for p in projections):
            self.panels = decode_kernels.PanelWeights([p.parts for p in projections],
                                                      None if biases[0] is None else biases,
                                                      width=panel_width, norms=[p.norm for p in projections])
            return
        weights = [p.weight for p in projections]
        single = len(weights) == 1
        if decode_kernels.runs(weights[0]):
            self.panels = decode_kernels.PanelWeights(weights, None if biases[0] is None else biases,
                                                      width=panel_width)
            return
        if weights[0].device.type == "cpu":
            # MKL's small-row products read an (in, out) weight that is not in cache faster than its
            # transposed view: one medium-model decode step's projections (2 agents x 16 rows, every
            # weight once) 5.3-5.6 -> 4.7 ms, a sampling call ~6% faster (AVX2-only EPYC). One copy
            # per sampling call, also for a single agent.
            self.weight = torch.stack([w.t() for w in weights])  # (A, in, out), contiguous
        else:
            self.weight = (weights[0].unsqueeze(0) if single else torch.stack(weights)).transpose(1, 2)  # (A, in, out)
        self.bias = None if biases[0] is None else (
            biases[0].unsqueeze(0) if single else torch.stack(biases)).unsqueeze(1)  # (A, 1, out)

    def __call__(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(A, rows, in) -> (A, rows, out); on the panel kernel, written into `out` (contiguous,
        fp32) when given (a `ProjectionRecord`'s slice; only where `StackedLeanDecoder.can_record`)."""
        if out is not None and self.panels is None:
            raise ValueError("only the panel kernel writes projections into a given output")
        if self.packed:
            outputs = [linear(part) for part, linear in zip(x.unbind(0), self.linears)]
            return outputs[0].unsqueeze(0) if len(outputs) == 1 else torch.stack(outputs)
        if self.panels is not None:
            if out is None and self._reuse_output:
                shape = (x.shape[0], x.shape[1], self.panels.out_features)
                if self._output is None or self._output.shape != shape:
                    self._output = torch.empty(shape, dtype=torch.float32)
                out = self._output
            return self.panels(x, out)
        if self.bias is None:
            return torch.bmm(x, self.weight)
        return torch.baddbmm(self.bias, x, self.weight)


@dataclass
class _StackedLayer:
    qkv: _AgentProjections
    o: _AgentProjections
    gate_up: _AgentProjections
    down: _AgentProjections
    eps: float


def _head_shape(config) -> Tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a Llama-family config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def _qkv_parts(attn, heads: int, kv_heads: int, head_dim: int):
    """The q, k and v projections' weights and biases (`_biases`) as the parts of one projection
    (rows q, k, v), each a view of its parameter, with the query and key rows of each head in
    `_pairs_adjacent` order (for `training_ops.rotary`)."""
    def reordered(t: torch.Tensor, count: int) -> torch.Tensor:
        return _pairs_adjacent(t, count, head_dim)

    weights = [reordered(attn.q_proj.weight, heads), reordered(attn.k_proj.weight, kv_heads), attn.v_proj.weight]
    biases = _biases(attn.q_proj, attn.k_proj, attn.v_proj)
    if biases:
        biases = [reordered(biases[0], heads), reordered(biases[1], kv_heads), biases[2]]
    return weights, biases


def _biases(*linears) -> List[torch.Tensor]:
    """The biases of `linears` as the bias parts of one projection: none when they have none (the
    supported architectures give all of a block's projections a bias, or none of them)."""
    biases = [linear.bias for linear in linears]
    return [] if any(b is None for b in biases) else biases


def _rotation_table(rotary, like: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's rotations cos + i sin at `positions`, positions.shape + (1, head_dim / 2),
    complex (at least complex64), on `like`'s device: one per rotary pair (i, i + head_dim / 2),
    for `training_ops.rotate_pairs`. On the CPU, rows of a table per rotary module
    (`_position_rotations`) where its rotations depend on the position alone."""
    if like.device.type == "cpu" and positions.numel() and _static_rotary(rotary):
        lowest, highest = (int(v) for v in torch.aminmax(positions))
        if lowest >= 0:
            return _position_rotations(rotary, like, highest + 1)[positions]
    return _rotations(rotary, like, positions)


def _static_rotary(rotary) -> bool:
    """Whether `rotary`'s rotation at a position is the same in every call: not the dynamic rope types,
    which rescale their frequencies by the sequence length they see."""
    rope_type = str(getattr(rotary, "rope_type", "default"))
    return "dynamic" not in rope_type and rope_type != "longrope"


#: Per rotary module, (what its table was built for, the table): `_position_rotations`.
_POSITION_ROTATIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _position_rotations(rotary, like: torch.Tensor, positions: int) -> torch.Tensor:
    """`rotary`'s rotations for positions 0 .. at least `positions` - 1, (positions, 1, head_dim / 2),
    built once per module, dtype and frequency tensor (rebuilt up to the next power of two when a
    run reaches past it). Each rotation is the rotary module's arithmetic on that position alone (the
    frequency times the position, then cos and sin), so a row of the table is bitwise what a call
    with any batch of positions gives (tested). Indexing it costs ~45 us where the rotary module
    cost ~350 us (an L loss chunk's 534 positions; it runs twice per sampling call and once per
    loss chunk)."""
    inv_freq = getattr(rotary, "inv_freq", None)
    key = (like.dtype, getattr(rotary, "attention_scaling", None),
           None if inv_freq is None else (inv_freq.data_ptr(), inv_freq._version, inv_freq.dtype))
    known = _POSITION_ROTATIONS.get(rotary)
    if known is not None and known[0] == key and known[1].shape[0] >= positions:
        return known[1]
    length = max(256, 1 << (positions - 1).bit_length())  # past any table it replaces: that one was too short
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whichever mode first asks
        table = _rotations(rotary, like, torch.arange(length, device=like.device).unsqueeze(0))[0]
    _POSITION_ROTATIONS[rotary] = (key, table)
    return table


def _rotations(rotary, like: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`_rotation_table` from the rotary module itself."""
    cos, sin = rotary(like.new_empty(1, 1, 1), positions)
    half = cos.shape[-1] // 2
    real = torch.promote_types(cos.dtype, torch.float32)
    return torch.complex(cos[..., :half].to(real), sin[..., :half].to(real)).unsqueeze(-2)


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _composed_attention(query_key: torch.Tensor, value: torch.Tensor, shape: "training_ops.AttentionShape",
                        prompt_bias: torch.Tensor, completion_bias: torch.Tensor, scale: float,
                        low: torch.dtype) -> torch.Tensor:
    """`training_ops.shared_prefix_attention` composed from torch ops (any dtype and device; its
    probabilities in `low`): `prompt_bias` from `_prompt_bias`, `completion_bias` (prompts, 1, 1, 1,
    S, P + S) additive over a completion token's prompt and own columns."""
    prompts, width, k, steps, heads, kv_heads, head_dim = shape
    group, q_size = heads // kv_heads, heads * head_dim
    prompt_tokens, rows = prompts * width, prompts * k
    query, key = query_key.split([heads, kv_heads], dim=1)
    (q_prompt, q_completion), (k_prompt, k_own), (v_prompt, v_own) = (
        t.split([prompt_tokens, t.shape[0] - prompt_tokens]) for t in (query, key, value))

    k_prompt = k_prompt.view(prompts, width, kv_heads, head_dim).permute(0, 2, 3, 1)  # (G, kv, D, P)
    v_prompt = v_prompt.view(prompts, width, kv_heads, head_dim).transpose(1, 2)  # (G, kv, P, D)
    attended_prompt = _prompt_attention(q_prompt.view(prompts, width, kv_heads, group, head_dim), k_prompt,
                                        v_prompt, prompt_bias, scale, low).reshape(prompt_tokens, q_size)

    # Completions: one product per prompt and KV head against the shared prompt keys (all K
    # samples' query rows at once), one per row against its own earlier tokens, one softmax.
    q_completion = q_completion.view(prompts, k, steps, kv_heads, group, head_dim).permute(0, 3, 1, 4, 2, 5)
    k_own = k_own.view(prompts, k, steps, kv_heads, head_dim).permute(0, 3, 1, 4, 2)  # (G, kv, K, D, S)
    v_own = v_own.view(prompts, k, steps, kv_heads, head_dim).permute(0, 3, 1, 2, 4)  # (G, kv, K, S, D)
    q_completion = q_completion.reshape(prompts, kv_heads, k, group * steps, head_dim)
    prefix_scores = torch.matmul(q_completion.view(prompts, kv_heads, k * group * steps, head_dim), k_prompt)
    own_scores = torch.matmul(q_completion, k_own)
    scores = torch.cat([prefix_scores.view(prompts, kv_heads, k, group * steps, width), own_scores], dim=-1)
    probs = torch.add(completion_bias, scores.view(prompts, kv_heads, k, group, steps, width + steps), alpha=scale)
    probs = probs.softmax(dim=-1, dtype=torch.float32).to(low).view(prompts, kv_heads, k, group * steps, width + steps)
    prefix_probs, own_probs = probs.split([width, steps], dim=-1)
    attended = torch.matmul(own_probs, v_own) + torch.matmul(
        prefix_probs.reshape(prompts, kv_heads, k * group * steps, width), v_prompt).view(
        prompts, kv_heads, k, group * steps, head_dim)
    attended = attended.view(prompts, kv_heads, k, group, steps, head_dim).permute(0, 2, 4, 1, 3, 5)
    return torch.cat([attended_prompt, attended.reshape(rows * steps, q_size)])


def _prompt_bias(prompt_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(prompts, 1, 1, W, W) additive bias of left-padded prompts' self-attention, broadcast over
    (kv, group): causal over each prompt's real tokens; a padding query sees itself only, so its
    (unused) row stays finite."""
    width = prompt_mask.shape[1]
    real = prompt_mask.bool()
    causal = torch.ones(width, width, dtype=torch.bool, device=prompt_mask.device).tril()
    seen = causal & (real[:, None, :] | torch.eye(width, dtype=torch.bool, device=prompt_mask.device))
    bias = torch.zeros(seen.shape, dtype=dtype, device=prompt_mask.device).masked_fill_(~seen, float("-inf"))
    return bias[:, None, None]


def _prompt_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                      scale: float, probs_dtype: torch.dtype) -> torch.Tensor:
    """Prompts' self-attention with grouped-query heads as rows of their KV head's product (no
    repeat of keys or values): query (prompts, W, kv, group, D), keys transposed (prompts, kv, D, W),
    values (prompts, kv, W, D), `bias` from `_prompt_bias`. Returns (prompts, W, kv, group, D), a
    permuted view."""
    prompts, width, kv_heads, group, head_dim = query.shape
    query = query.permute(0, 2, 3, 1, 4).reshape(prompts, kv_heads, group * width, head_dim)
    scores = torch.matmul(query, keys).view(prompts, kv_heads, group, width, width)
    probs = torch.add(bias, scores, alpha=scale).softmax(dim=-1, dtype=torch.float32).to(probs_dtype)
    attended = torch.matmul(probs.view(prompts, kv_heads, group * width, width), values)
    return attended.view(prompts, kv_heads, group, width, head_dim).permute(0, 3, 1, 2, 4)


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its scale (the decoders fold that into the next projection), in fp32 as the
    transformers norm computes it, returned in x's dtype."""
    return _cast(F.rms_norm(_cast(x, torch.float32), (x.shape[-1],), eps=eps), x.dtype)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without a dispatch when x already has it: a decode step makes ~45 such casts,
    most of them no-ops, at ~1-2 us each."""
    return x if x.dtype == dtype else x.to(dtype)


def _pairs_adjacent(t: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """A view (heads, head_dim / 2, 2, ...) of a query or key projection's weight or bias (rows
    head-major) in which each head's rotary pair (i, i + head_dim / 2) is adjacent: flattened, the
    rows run 0, h, 1, h + 1, ... per head (h = head_dim / 2)."""
    return t.view(heads, 2, head_dim // 2, *t.shape[1:]).transpose(1, 2)


def cache_argument(model) -> str:
    """Keyword under which this model's forward takes a KV cache (transformers renamed
    `past_key_values` to `cache`)."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
