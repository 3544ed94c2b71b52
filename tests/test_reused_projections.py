"""The policy-gradient pass reuses the sampling pass's projections (`lean.ProjectionRecord`) and
gets the log-probs and gradients it would have computed, only while the parameters are unchanged."""

from __future__ import annotations

import json
from typing import Optional

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from comlrl.losses import bucketed_width, completion_mask, shared_prompt_token_logprobs, width_buckets
from comlrl.models import decode_kernels, lean, load_causal_lm, load_tokenizer, training_ops
from comlrl.models.lean import StackedLeanDecoder, lean_decoder_for, shared_prompt_logits
from comlrl.models.lean import _StackedRecord
from comlrl.rollout import SamplingSettings, sample_agents
from test_lean_training_forward import tiny

pytestmark = pytest.mark.skipif(decode_kernels.library() is None,
                                reason="records need the C decode kernels (an AVX2/FMA CPU and a C compiler)")

EOS = 5
ARCHITECTURES = {"qwen2-gqa": lambda: tiny(Qwen2Config), "llama-mha": lambda: tiny(LlamaConfig, num_key_value_heads=4),
                 "llama-biases": lambda: tiny(LlamaConfig, attention_bias=True, mlp_bias=True),
                 "mistral": lambda: tiny(MistralConfig, sliding_window=None)}


def _perturbed(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _two_agents(name: str):
    """Two models of one architecture with different weights."""
    models = [ARCHITECTURES[name]() for _ in range(2)]
    _perturbed(models[1], 1)
    return models


def _teacher_forced_records(models, prompt_ids, prompt_mask, completions, k):
    """Each model's ProjectionRecord of a decode that feeds `completions` (rows, T) after the
    prompts, as `rollout._decode` runs it (all models stacked, one step per token), recording every
    projection (the trainer records `lean.RECORDED_PROJECTIONS`), so that each replay is tested."""
    _, _, record = _stacked_decode(models, prompt_ids, prompt_mask, completions, k,
                                   steps_run=completions.shape[1] - 1)  # the last token is only predicted
    return record.split(prompt_ids.shape[0], k)


def _logprobs_and_grads(model, prompt_ids, prompt_mask, completions, mask, k, replayed=None):
    model.zero_grad(set_to_none=True)
    logprobs = shared_prompt_token_logprobs(model, prompt_ids, prompt_mask, completions, mask, k, None, replayed)
    (logprobs * mask).sum().backward()
    return (logprobs * mask).detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_replayed_projections_give_the_recomputed_log_probs_and_gradients(name):
    """Three prompts of different lengths (left-padded), K=3 completions each, one ending at EOS:
    for any subset of prompts and any crop of their padding columns (as the trainer's chunks take
    them), the forward on recorded projections matches the recomputed one in log-probs and in
    every parameter's gradient, to float rounding; a record of other parameters does not."""
    models = _two_agents(name)
    k, steps = 3, 9
    torch.manual_seed(2)
    prompt_ids = torch.randint(6, 97, (3, 8))
    prompt_mask = torch.ones(3, 8, dtype=torch.long)
    prompt_mask[0, :5], prompt_mask[2, :2] = 0, 0
    completions = torch.randint(6, 97, (3 * k, steps))
    completions[4, 3] = EOS
    mask = completion_mask(completions, [EOS])
    records = _teacher_forced_records(models, prompt_ids, prompt_mask, completions, k)
    for agent, (model, record) in enumerate(zip(models, records)):
        model.train()
        for nodes, first_column, width in (([0, 1, 2], 0, steps), ([2, 0], 2, steps), ([0], 5, 4), ([1], 0, 1)):
            rows = torch.tensor([n * k + j for n in nodes for j in range(k)])
            args = (model, prompt_ids[nodes, first_column:], prompt_mask[nodes, first_column:],
                    completions[rows, :width], mask[rows, :width], k)
            expected, expected_grads = _logprobs_and_grads(*args)
            replayed, grads = _logprobs_and_grads(*args, record.replayed(nodes, first_column, width - 1))
            torch.testing.assert_close(replayed, expected, rtol=1e-5, atol=2e-5)
            for got, want in zip(grads, expected_grads):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        # The record is really what the forward uses: the other agent's parameters give other log-probs.
        everything = (model, prompt_ids, prompt_mask, completions, mask, k)
        other = records[1 - agent].replayed([0, 1, 2], 0, steps - 1)
        wrong, _ = _logprobs_and_grads(*everything, other)
        assert (wrong - _logprobs_and_grads(*everything)[0]).abs().max() > 1e-2


def test_a_replayed_forward_keeps_no_gate_up_output():
    """With gate/up and down replayed, no layer's gate/up output is kept from the forward to the
    backward pass (SwiGLU's backward takes it from the record); the recomputing forward keeps one
    per layer."""
    model = tiny(Qwen2Config)
    model.train()
    k, steps = 2, 5
    prompt_ids, prompt_mask = torch.randint(6, 97, (1, 4)), torch.ones(1, 4, dtype=torch.long)
    completions = torch.randint(6, 97, (k, steps))
    (record,) = _teacher_forced_records([model], prompt_ids, prompt_mask, completions, k)
    gate_up_width = 2 * model.config.intermediate_size
    tokens = 4 + k * (steps - 1)
    last_layer_tokens = 1 + k * (steps - 1)  # the prompt's last token and the completions' (`lm_head_rows`)

    def kept_gate_ups(replayed):
        kept = []

        def keep(t):
            kept.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            logits = shared_prompt_logits(model, prompt_ids, prompt_mask, completions, k, replayed=replayed)
        logits.sum().backward()
        return kept.count((tokens, gate_up_width)) + kept.count((last_layer_tokens, gate_up_width))

    assert kept_gate_ups(None) == model.config.num_hidden_layers
    assert kept_gate_ups(record.replayed([0], 0, steps - 1)) == 0


def test_swiglu_backward_reads_the_recorded_gate_up_rows_in_place(monkeypatch):
    """SwiGLU's backward reads a replayed gate/up's rows where the record holds them (no gathered
    copy): the addresses are the gather's rows, in its order, and the log-probs and every gradient
    equal the gathering path's bit for bit, for prompts and crops as the trainer's chunks take them."""
    model = tiny(Qwen2Config)
    model.train()
    k, steps = 3, 7
    torch.manual_seed(4)
    prompt_ids, prompt_mask = torch.randint(6, 97, (3, 6)), torch.ones(3, 6, dtype=torch.long)
    prompt_mask[1, :2] = 0
    completions = torch.randint(6, 97, (3 * k, steps))
    mask = completion_mask(completions, [EOS])
    (record,) = _teacher_forced_records([model], prompt_ids, prompt_mask, completions, k)
    gate_up = lean.PROJECTIONS.index("gate_up")
    nodes, first_column, width = [2, 1], 1, steps - 2
    addresses, owners = record.replayed(nodes, first_column, width - 1)[0][gate_up].take_rows()
    gathered = record.replayed(nodes, first_column, width - 1)[0][gate_up].take()
    grad_hidden = torch.randn(gathered.shape[0], gathered.shape[1] // 2)
    in_place = decode_kernels.swiglu_backward_rows(addresses, owners, grad_hidden)
    copied = decode_kernels.swiglu_backward(gathered, grad_hidden)
    assert all(torch.equal(a, b) for a, b in zip(in_place, copied))
    with pytest.raises(ValueError, match="outside"):
        decode_kernels.swiglu_backward_rows(addresses + 8 * gathered.numel(), owners, grad_hidden)

    rows = torch.tensor([n * k + j for n in nodes for j in range(k)])
    args = (model, prompt_ids[nodes, first_column:], prompt_mask[nodes, first_column:], completions[rows, :width],
            mask[rows, :width], k)
    taken = []
    original = decode_kernels.swiglu_backward_rows
    monkeypatch.setattr(decode_kernels, "swiglu_backward_rows", lambda *a: taken.append(1) or original(*a))
    logprobs, grads = _logprobs_and_grads(*args, record.replayed(nodes, first_column, width - 1))
    assert len(taken) == model.config.num_hidden_layers
    monkeypatch.setattr(training_ops.Replayed, "take_rows", lambda self: None)  # every consumer gathers
    expected, expected_grads = _logprobs_and_grads(*args, record.replayed(nodes, first_column, width - 1))
    assert torch.equal(logprobs, expected)
    assert all(torch.equal(got, want) for got, want in zip(grads, expected_grads))


def test_the_loss_takes_the_logits_sampling_drew_from():
    """Where the LM head runs on the panel kernel, a replayed forward's logits are the sampling
    pass's own, bit for bit: each prompt's last position's from the prefill, completion token t's
    from decode step t (the logits its next token was drawn from)."""
    models = _two_agents("qwen2-gqa")
    k, steps = 2, 5
    torch.manual_seed(3)
    prompt_ids = torch.randint(6, 97, (2, 6))
    prompt_mask = torch.ones(2, 6, dtype=torch.long)
    prompt_mask[1, :2] = 0
    completions = torch.randint(6, 97, (2 * k, steps))
    step_logits, _, stacked = _stacked_decode(models, prompt_ids, prompt_mask, completions, k, steps_run=steps - 1)
    rows = 2 * k
    for agent, (model, record) in enumerate(zip(models, stacked.split(2, k))):
        replayed = record.replayed([0, 1], 0, steps - 1)
        assert len(replayed) == len(model.model.layers) + 1  # the layers', then the LM head's
        with torch.no_grad():
            logits = shared_prompt_logits(model, prompt_ids, prompt_mask, completions, k, replayed=replayed)
        decoded = torch.stack([step.view(2, rows, -1)[agent] for step in step_logits], dim=1)
        assert torch.equal(logits[:, 1:], decoded)
        assert torch.equal(logits[:, 0], stacked.logits_prompt[agent].repeat_interleave(k, dim=0))
        # Recomputed, the LM head's product sums in another order: the same to rounding, not bitwise.
        with torch.no_grad():
            recomputed = shared_prompt_logits(model, prompt_ids, prompt_mask, completions, k)
        torch.testing.assert_close(recomputed, logits, rtol=1e-4, atol=1e-4)
        assert not torch.equal(recomputed, logits)


def test_replayed_outputs_are_taken_once():
    model = tiny(Qwen2Config)
    prompt_ids, prompt_mask = torch.randint(6, 97, (1, 4)), torch.ones(1, 4, dtype=torch.long)
    completions = torch.randint(6, 97, (2, 3))
    (record,) = _teacher_forced_records([model], prompt_ids, prompt_mask, completions, 2)
    replayed = record.replayed([0], 0, 2)
    assert shared_prompt_logits(model, prompt_ids, prompt_mask, completions, 2, replayed=replayed) is not None
    with pytest.raises(RuntimeError, match="already taken"):
        shared_prompt_logits(model, prompt_ids, prompt_mask, completions, 2, replayed=replayed)


def test_sampling_records_what_the_update_recomputes(tiny_model_dir):
    """Through `sample_agents` (two fused agents, the trainer's chunking of prompts): the records
    match the recomputed forward; released records lend their buffers to the next call."""
    models = [load_causal_lm(tiny_model_dir), _perturbed(load_causal_lm(tiny_model_dir), 3)]
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = ["A tale of two robots.", "Hi", "Describe the sea in one long sentence, slowly."]
    settings = SamplingSettings(num_generations=2, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=None)
    keys = [[("test", i, a) for i in range(len(prompts))] for a in range(2)]
    samples = sample_agents(models, [tokenizer] * 2, [prompts] * 2, settings, keys, [None, None], record_projections=True)
    plain = sample_agents(models, [tokenizer] * 2, [prompts] * 2, settings, keys, [None, None])
    assert all(s.recorded is not None for s in samples) and all(s.recorded is None for s in plain)
    for s, p in zip(samples, plain):  # recording changes no sampled token
        assert torch.equal(s.completion_ids, p.completion_ids)
    k = settings.num_generations
    for model, s in zip(models, samples):
        model.train()
        for nodes in ([1, 2], [0]):
            rows = torch.tensor([n * k + j for n in nodes for j in range(k)])
            prompt_mask = s.prompt_mask[nodes]
            columns = prompt_mask.shape[1]
            buckets = width_buckets(torch.device("cpu"), torch.float32)  # as the trainer picks them
            first = columns - bucketed_width(columns - int(prompt_mask.any(dim=0).nonzero()[0]), columns, buckets)
            width = bucketed_width(int(s.completion_mask[rows].sum(dim=1).max()), s.completion_mask.shape[1], buckets)
            args = (model, s.prompt_ids[nodes, first:], prompt_mask[:, first:], s.completion_ids[rows, :width],
                    s.completion_mask[rows, :width], k)
            expected, expected_grads = _logprobs_and_grads(*args)
            replayed, grads = _logprobs_and_grads(*args, s.recorded.replayed(nodes, first, width - 1))
            torch.testing.assert_close(replayed, expected, rtol=1e-5, atol=2e-5)
            for got, want in zip(grads, expected_grads):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    # Step buffers return to a spare set once every agent of their call released its record.
    recorded = lean.PROJECTIONS.index(lean.RECORDED_PROJECTIONS[0])

    def buffer(agent_samples):
        return agent_samples.recorded.steps[0][recorded].untyped_storage().data_ptr()

    first = buffer(samples[0])
    samples[0].recorded.release()
    second = sample_agents(models, [tokenizer] * 2, [prompts] * 2, settings, keys, [None, None], record_projections=True)
    assert buffer(second[0]) != first  # agent 2 still holds the first call's record
    samples[1].recorded.release()
    third = sample_agents(models, [tokenizer] * 2, [prompts] * 2, settings, keys, [None, None], record_projections=True)
    assert buffer(third[0]) == first
    for fresh, reused in zip(second, third):  # a call on reused buffers records what a fresh one does
        written = fresh.completion_ids.shape[1] - 1  # steps this agent's tokens went through
        assert torch.equal(reused.recorded.steps[0][recorded][:written], fresh.recorded.steps[0][recorded][:written])
    for s in second + third:
        s.recorded.release()


def test_six_wide_panels_sample_and_record_what_sixteen_wide_ones_do(tiny_model_dir, monkeypatch):
    """At whole blocks of 16 rows per agent, AVX2 CPUs decode through 6-wide panels (weights
    streamed once per step); every token, recorded projection and recorded logit equals what the
    16-wide kernels give, bit for bit."""
    if decode_kernels.library() is None:
        pytest.skip("no kernel library here")
    models = [load_causal_lm(tiny_model_dir), _perturbed(load_causal_lm(tiny_model_dir), 5)]
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = ["Sixteen rows, two prompts.", "Hi"]
    settings = SamplingSettings(num_generations=8, max_new_tokens=9, temperature=1.0, top_p=1.0, top_k=None)
    keys = [[("six", i, a) for i in range(len(prompts))] for a in range(2)]
    widths = []
    packed = decode_kernels.PanelWeights.__init__

    def noting_width(self, *args, **kwargs):
        packed(self, *args, **kwargs)
        widths.append(self.width)

    monkeypatch.setattr(decode_kernels.PanelWeights, "__init__", noting_width)
    results = {}
    for width in (None, 16):  # None: the width `panel_width` picks for 16 rows
        if width is not None:
            monkeypatch.setattr(decode_kernels, "panel_width", lambda rows: width)
        widths.clear()
        results[width] = sample_agents(models, [tokenizer] * 2, [prompts] * 2, settings, keys, [None, None],
                                       record_projections=True)
        assert set(widths) == {width or (16 if decode_kernels.AVX512_PANELS else 6)}
    for chosen, wide in zip(results[None], results[16]):
        assert torch.equal(chosen.completion_ids, wide.completion_ids)
        written = chosen.completion_ids.shape[1] - 1
        for layer_chosen, layer_wide in zip(chosen.recorded.steps, wide.recorded.steps):
            for a, b in zip(layer_chosen, layer_wide):
                assert (a is None) == (b is None) and (a is None or torch.equal(a[:written], b[:written]))
        for layer_chosen, layer_wide in zip(chosen.recorded.prompt, wide.recorded.prompt):
            for a, b in zip(layer_chosen, layer_wide):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        assert chosen.recorded.logits is not None
        assert torch.equal(chosen.recorded.logits[0], wide.recorded.logits[0])
        assert torch.equal(chosen.recorded.logits[1][:written + 1], wide.recorded.logits[1][:written + 1])
    for s in results[None] + results[16]:
        s.recorded.release()


def test_agents_decoding_apart_each_find_their_step_buffers_again(tiny_model_dir, monkeypatch):
    """Agents above the fusion size decode one after the other, each into its own record, both
    alive at once; once released, the next call's records reuse both sets of step buffers."""
    monkeypatch.setattr(lean, "FUSE_MAX_PARAMETERS_CPU", 0)
    monkeypatch.setattr(lean, "FUSE_MAX_PARAMETERS", 0)
    models = [load_causal_lm(tiny_model_dir), _perturbed(load_causal_lm(tiny_model_dir), 3)]
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = ["Two agents, apart.", "Hi"]
    settings = SamplingSettings(num_generations=3, max_new_tokens=7, temperature=1.0, top_p=1.0, top_k=None)
    keys = [[("apart", i, a) for i in range(len(prompts))] for a in range(2)]
    recorded = lean.PROJECTIONS.index(lean.RECORDED_PROJECTIONS[0])

    def buffers(samples):
        assert all(s.recorded._owner.agents == 1 for s in samples)  # one record per agent: decoded apart
        return {s.recorded.steps[0][recorded].untyped_storage().data_ptr() for s in samples}

    first = sample_agents(models, [tokenizer] * 2, [prompts] * 2, settings, keys, [None, None], record_projections=True)
    held = buffers(first)
    assert len(held) == 2
    for s in first:
        s.recorded.release()
    second = sample_agents(models, [tokenizer] * 2, [prompts] * 2, settings, keys, [None, None], record_projections=True)
    assert buffers(second) == held
    for s in second:
        s.recorded.release()


@pytest.mark.parametrize("train_batch_size", [2, 1])
def test_the_update_reuses_records_until_the_first_optimizer_step(make_trainer, tmp_path, monkeypatch,
                                                                   train_batch_size):
    """Two prompts per update: one minibatch (train_batch_size 2) replays the sampling pass's
    projections; with two minibatches only the first does (the second runs after an optimizer
    step). Every record is released. Training agrees with a run that recomputes (the losses to
    float rounding)."""
    replays, releases = [], []
    original_replayed, original_release = lean.ProjectionRecord.replayed, lean.ProjectionRecord.release
    monkeypatch.setattr(lean.ProjectionRecord, "replayed",
                        lambda self, *a: replays.append(a) or original_replayed(self, *a))
    monkeypatch.setattr(lean.ProjectionRecord, "release", lambda self: releases.append(1) or original_release(self))
    losses = {}
    for reuse in (True, False):
        monkeypatch.setattr(lean, "REUSE_SAMPLING_PROJECTIONS", reuse)
        metrics = tmp_path / f"metrics-{reuse}.jsonl"
        trainer = make_trainer(num_train_epochs=2, num_generations=3, max_new_tokens=10,
                               train_batch_size=train_batch_size, metrics_path=str(metrics))
        trainer.train()
        losses[reuse] = [[row[key] for key in sorted(row) if key.endswith("loss")]
                         for row in map(json.loads, metrics.read_text().splitlines())]
        if reuse:
            updates = len(losses[reuse])
            assert updates == 4  # 4 prompts, 2 per update, 2 epochs
            assert len(replays) == 2 * updates  # each agent's first minibatch of each update, not its second
            assert len(releases) == 2 * updates
    assert len(replays) == 2 * 4  # nothing recorded or replayed when turned off
    assert all(losses[True]) and torch.allclose(torch.tensor(losses[True]), torch.tensor(losses[False]),
                                                rtol=1e-4, atol=1e-6)


def test_multi_turn_updates_record_and_replay_only_the_first_turn(make_trainer, monkeypatch):
    """Later turns are trained after the first optimizer step, so sampling records only turn 1."""
    from comlrl.transitions import revise_with_partner_feedback

    made, replays = [], []
    original_init, original_replayed = lean.ProjectionRecord.__init__, lean.ProjectionRecord.replayed
    monkeypatch.setattr(lean.ProjectionRecord, "__init__", lambda self, *a: made.append(1) or original_init(self, *a))
    monkeypatch.setattr(lean.ProjectionRecord, "replayed", lambda self, *a: replays.append(1) or original_replayed(self, *a))
    trainer = make_trainer(num_turns=2, discount=0.5, external_transition=revise_with_partner_feedback)
    trainer.train()
    assert len(made) == len(replays) == 2 * 2  # 2 agents x 2 updates (4 prompts, 2 per update)


@pytest.fixture
def make_trainer(tiny_model_dir):
    from comlrl.data import story_prompts
    from comlrl.rewards import length_ratio_reward
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    def build(metrics_path=None, external_transition=None, **config):
        settings = dict(num_turns=1, num_train_epochs=1, num_generations=2, max_new_tokens=8, logging_steps=1,
                        show_progress=False)
        settings.update(config)
        return MAGRPOTrainer(agents=[load_causal_lm(tiny_model_dir) for _ in range(2)],
                             tokenizer=load_tokenizer(tiny_model_dir), reward_func=length_ratio_reward,
                             train_dataset=story_prompts(), args=MAGRPOConfig(**settings), metrics_path=metrics_path,
                             external_transition=external_transition)
    return build


def _stacked_decode(models, prompt_ids, prompt_mask, completions, k, whole_step: bool = True,
                    steps_run: Optional[int] = None):
    """(each step's logits, the decode cache, the record) of a teacher-forced stacked decode of
    the first `steps_run` (default all) tokens of `completions` with every projection recorded, the
    step run as one C call or as the per-kernel calls."""
    with torch.no_grad():
        decoder = StackedLeanDecoder([lean_decoder_for(m) for m in models])
        assert decoder.can_record and decoder.whole_step_kernel
        decoder.whole_step_kernel = whole_step
        count, (prompts, width), steps = len(models), prompt_ids.shape, completions.shape[1]
        record = _StackedRecord(decoder, prompts, width, prompts * k, steps, projections=lean.PROJECTIONS)
        _, cache = decoder.prefill(prompt_ids.repeat(count, 1), prompt_mask.repeat(count, 1), k, steps, record)
        rows_mask = torch.cat([prompt_mask.repeat_interleave(k, dim=0), torch.ones(prompts * k, steps, dtype=torch.long)], 1)
        bias = decoder.attention_bias(rows_mask.repeat(count, 1))
        last = (prompt_mask.cumsum(1) - 1).clamp(min=0)[:, -1:].repeat_interleave(k, dim=0).repeat(count, 1)
        rotations = decoder.rotary_table(last + torch.arange(1, steps + 1)).transpose(0, 1).contiguous()
        logits = [decoder.step(completions[:, t].repeat(count), rotations[t], cache, t, bias, record)
                  for t in range(steps if steps_run is None else steps_run)]
    return logits, cache, record


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_whole_step_kernel_decodes_what_the_per_kernel_step_decodes_bit_for_bit(name, monkeypatch):
    """Two agents stacked, left-padded prompts, K=3: one C call per step gives the per-kernel
    step's logits, cache and recorded projections, bit for bit, and builds its plan once."""
    models = _two_agents(name)
    k, steps = 3, 6
    torch.manual_seed(2)
    prompt_ids = torch.randint(6, 97, (2, 7))
    prompt_mask = torch.ones(2, 7, dtype=torch.long)
    prompt_mask[1, :3] = 0
    completions = torch.randint(0, 97, (2 * k, steps))
    plans = []
    original = decode_kernels.DecodeStepPlan.__init__
    monkeypatch.setattr(decode_kernels.DecodeStepPlan, "__init__",
                        lambda self, **kw: plans.append(1) or original(self, **kw))
    whole = _stacked_decode(models, prompt_ids, prompt_mask, completions, k, whole_step=True)
    assert plans == [1]
    per_kernel = _stacked_decode(models, prompt_ids, prompt_mask, completions, k, whole_step=False)
    assert plans == [1]
    for a, b in zip(whole[0], per_kernel[0]):
        assert torch.equal(a, b)
    for name_ in ("keys", "values"):
        for a, b in zip(getattr(whole[1], name_), getattr(per_kernel[1], name_)):
            assert torch.equal(a, b)
    for layer_a, layer_b in zip(whole[2].steps, per_kernel[2].steps):
        for a, b in zip(layer_a, layer_b):
            assert torch.equal(a, b)
    # The logits are those of real rows: not all equal, and different between the agents.
    assert not torch.equal(whole[0][0][:2 * k], whole[0][0][2 * k:])


def test_the_whole_step_kernel_refuses_a_token_outside_the_vocabulary():
    model = ARCHITECTURES["qwen2-gqa"]()
    with torch.no_grad():
        decoder = StackedLeanDecoder([lean_decoder_for(model)])
        prompt_ids, prompt_mask = torch.randint(6, 97, (1, 4)), torch.ones(1, 4, dtype=torch.long)
        _, cache = decoder.prefill(prompt_ids, prompt_mask, 2, 3)
        bias = decoder.attention_bias(torch.ones(2, 7, dtype=torch.long))
        rotations = decoder.rotary_table(torch.arange(4, 7).repeat(2, 1)).transpose(0, 1).contiguous()
        keys_before = [k.clone() for k in cache.keys]
        with pytest.raises(ValueError, match="outside the vocabulary"):
            decoder.step(torch.tensor([3, 97]), rotations[0], cache, 0, bias)
        assert all(torch.equal(a, b) for a, b in zip(keys_before, cache.keys))  # nothing written
        with pytest.raises(ValueError, match="step below"):
            decoder.step(torch.tensor([3, 4]), rotations[0], cache, 3, bias)
