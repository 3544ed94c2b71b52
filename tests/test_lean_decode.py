"""The lean decode step computes the same logits as the transformers model it reads."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, MistralConfig, Qwen2Config

from comlrl import rollout
from comlrl.models import lean as lean_module
from comlrl.models import decode_kernels, onednn, pages
from comlrl.models import load_causal_lm, load_tokenizer
from comlrl.models.lean import StackedLeanDecoder, cache_argument, lean_decoder_for, supports_lean_path
from comlrl.precision import autocast
from comlrl.rollout import SamplingSettings, sample_completions


def tiny(config_cls, **extra):
    torch.manual_seed(0)
    settings = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config = config_cls(**{**settings, **extra})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases start at zero, where leaving one out would go unnoticed
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(std=0.5)
    return model


MODELS = [tiny(Qwen2Config), tiny(LlamaConfig), tiny(LlamaConfig, num_key_value_heads=4),
          tiny(LlamaConfig, attention_bias=True, mlp_bias=True), tiny(MistralConfig, sliding_window=None)]
MODEL_IDS = ["qwen2-gqa", "llama-gqa", "llama-mha", "llama-biases", "mistral"]


LEFT_PADDED_PROMPTS = (torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]]),  # row 0 left-padded
                       torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))


def _lean_and_reference_logits(model, compute_dtype=None, attention_dtype=None, prompts=LEFT_PADDED_PROMPTS):
    """(lean logits, model logits) of 3-token continuations of a 2-prompt batch (by default
    left-padded), two samples per prompt (so the samples share their prompt's cache), the model's
    forward run on the full sequences under autocast to `compute_dtype` as the trainer runs it."""
    prompt, prompt_mask = prompts
    width = prompt.shape[1]
    continuation = torch.tensor([[11, 12, 13], [14, 15, 16], [21, 22, 23], [24, 25, 26]])  # (prompt, sample)
    lean = lean_decoder_for(model, compute_dtype, attention_dtype)
    assert lean is not None
    with torch.no_grad(), autocast(torch.device("cpu"), compute_dtype):
        full_ids = torch.cat([prompt.repeat_interleave(2, dim=0), continuation], 1)
        full_mask = torch.cat([prompt_mask.repeat_interleave(2, dim=0), torch.ones(4, 3, dtype=torch.long)], 1)
        full_positions = (full_mask.cumsum(1) - 1).clamp(min=0)
        reference = model(input_ids=full_ids, attention_mask=full_mask, position_ids=full_positions).logits[:, width:]
    with torch.no_grad():
        decoder = StackedLeanDecoder([lean])
        _, buffers = decoder.prefill(prompt, prompt_mask, 2, 3)
        bias = decoder.attention_bias(full_mask)
        rotation = decoder.rotary_table(full_positions[:, width:])
        steps = [decoder.step(continuation[:, t], rotation[:, t], buffers, t, bias) for t in range(3)]
    return torch.stack(steps, dim=1).float(), reference.float()


@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_lean_steps_match_the_model_forward_with_left_padding(model):
    lean, reference = _lean_and_reference_logits(model)
    assert torch.allclose(lean, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", MODELS[:2], ids=MODEL_IDS[:2])
def test_steps_whose_rows_match_the_prefill_rows_still_read_the_prompt_cache(model):
    """Two 2-token prompts, two samples each: the prefill's projections see as many rows as each
    step's, so a step reuses the buffers the prefill wrote its projections into (where the decode
    kernels run); the prompt's cached keys and values must not live in them."""
    prompts = (torch.tensor([[5, 6], [1, 2]]), torch.ones(2, 2, dtype=torch.long))
    lean, reference = _lean_and_reference_logits(model, prompts=prompts)
    assert torch.allclose(lean, reference, atol=1e-5, rtol=1e-5)


def _layer_kv(cache, index: int):
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[index].keys, layers[index].values
    return cache.key_cache[index], cache.value_cache[index]  # older transformers


@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_lean_prefill_matches_the_model_forward_with_left_padding(model):
    """The lean prefill's next-token logits, and the keys and values it writes into the decode
    cache's shared prefix at every real prompt token, are the model's own."""
    prompt = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])  # row 0 left-padded
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
        reference = model(input_ids=prompt, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                          **{cache_argument(model): cache}).logits[:, -1]
        logits, buffers = StackedLeanDecoder([lean_decoder_for(model)]).prefill(prompt, prompt_mask, 2, 3)
    assert torch.allclose(logits, reference, atol=1e-5, rtol=1e-5)
    real = prompt_mask.bool()
    # The decode cache holds keys with each head's rotary pairs (i, i + D/2) adjacent (see LeanDecoder).
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    pairs_adjacent = torch.arange(head_dim).view(2, head_dim // 2).t().reshape(-1)  # 0, D/2, 1, D/2 + 1, ...
    for index in range(len(model.model.layers)):
        keys, values = _layer_kv(cache, index)  # (prompts, kv, width, D)
        keys = keys[..., pairs_adjacent]
        lean_keys = buffers.prefix_keys[index].permute(0, 3, 1, 2)  # stored (prompts, kv, D, width)
        assert torch.allclose(lean_keys[real], keys.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
        assert torch.allclose(buffers.prefix_values[index].transpose(1, 2)[real], values.transpose(1, 2)[real],
                              atol=1e-5, rtol=1e-5)
    assert buffers.keys[0].shape == (4, model.config.num_key_value_heads, head_dim, 3)  # 2 samples per prompt, 3 new


@pytest.mark.parametrize("attention_dtype", [None, torch.bfloat16], ids=["cpu-attention-fp32", "gpu-attention-bf16"])
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_lean_bf16_steps_match_the_autocast_forward(model, attention_dtype):
    """Mixed precision: bf16 projections; attention and KV cache in fp32 (the CPU's choice) or bf16
    (the GPU's). The model under autocast rounds differently, so they agree to bf16 rounding, not
    bitwise: within 2% of the logits' scale of each other and of the fp32 logits."""
    lean, reference = _lean_and_reference_logits(model, torch.bfloat16, attention_dtype)
    exact, _ = _lean_and_reference_logits(model)
    scale = exact.abs().max()
    assert (lean - reference).abs().max() <= 0.02 * scale
    assert (lean - exact).abs().max() <= 0.02 * scale
    assert not torch.equal(lean, exact)  # the bf16 path really ran in bf16


def test_lean_and_model_forward_sample_the_same_tokens(tiny_model_dir, monkeypatch):
    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    settings = SamplingSettings(num_generations=4, max_new_tokens=32, temperature=0.8, top_p=0.9, top_k=50)
    prompts = ["Hi:", "Design a playground on Mars:"]
    lean = sample_completions(model, tok, prompts, settings, keys=[("x",), ("y",)])
    monkeypatch.setattr(rollout, "lean_decoder_for", lambda model, compute_dtype=None: None)
    plain = sample_completions(model, tok, prompts, settings, keys=[("x",), ("y",)])
    assert torch.equal(lean.completion_ids, plain.completion_ids)


def test_sampling_switches_to_eval_mode_only_for_the_models_own_forward(tiny_model_dir, monkeypatch):
    """The lean decoder runs no dropout and leaves the model's mode alone; sampling through the model's
    own forward puts it in eval mode (no dropout: the same tokens) and restores its mode after."""
    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5  # a training-mode forward of the model would drop
    model.train()
    switches = []

    def train(self, mode=True):
        switches.append(mode)
        return torch.nn.Module.train(self, mode)

    monkeypatch.setattr(type(model), "train", train)
    settings = SamplingSettings(num_generations=2, max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=50)
    lean = sample_completions(model, tok, ["Hi:"], settings, keys=[("m",)])
    assert switches == [] and model.training
    monkeypatch.setattr(rollout, "lean_decoder_for", lambda model, compute_dtype=None: None)
    plain = sample_completions(model, tok, ["Hi:"], settings, keys=[("m",)])
    assert switches == [False, True] and all(m.training for m in model.modules())
    assert torch.equal(lean.completion_ids, plain.completion_ids)


@pytest.mark.parametrize("model", MODELS[:2], ids=MODEL_IDS[:2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotation_tables_are_bitwise_the_rotary_modules_rotations(model, dtype):
    """The CPU's per-module table of rotations gives, row for row, what the rotary module computes
    for any batch of positions: in a decode's (rows, steps) shape and a loss chunk's (1, tokens),
    before and after the table grows, and built inside inference mode but read outside it."""
    rotary, like = model.model.rotary_emb, model.model.embed_tokens.weight.detach().to(dtype)
    lean_module._POSITION_ROTATIONS.pop(rotary, None)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        lean_module._rotation_table(rotary, like, torch.arange(5).repeat(3, 1))
    built = lean_module._POSITION_ROTATIONS[rotary][1]
    assert built.shape[0] == 256 and not built.is_inference()
    for positions in [torch.randint(0, 256, (4, 9), generator=generator),
                      torch.randint(0, 256, (1, 531), generator=generator),
                      torch.randint(0, 1500, (2, 33), generator=generator)]:  # past the first table: it grows
        cached = lean_module._rotation_table(rotary, like, positions)
        assert cached.shape[:-1] == positions.shape + (1,)
        assert torch.equal(cached, lean_module._rotations(rotary, like, positions))
    assert lean_module._POSITION_ROTATIONS[rotary][1].shape[0] == 2048
    negative = torch.tensor([[-3, 0, 5]])  # not a table row: the module computes them
    assert torch.equal(lean_module._rotation_table(rotary, like, negative), lean_module._rotations(rotary, like, negative))


def test_dynamic_rope_types_are_computed_per_call():
    """A dynamic rope type rescales its frequencies by the lengths it sees, so it gets no table."""
    model = tiny(LlamaConfig, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    rotary = model.model.rotary_emb
    assert not lean_module._static_rotary(rotary)
    lean_module._rotation_table(rotary, model.model.embed_tokens.weight, torch.arange(7).unsqueeze(0))
    assert rotary not in lean_module._POSITION_ROTATIONS
    assert lean_module._static_rotary(MODELS[0].model.rotary_emb)


def test_unknown_architectures_fall_back():
    from transformers import GPT2Config

    torch.manual_seed(0)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert lean_decoder_for(gpt2) is None


def _perturbed(model, seed: int):
    """The same architecture with different weights (a second agent after some training)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_agents_of_one_architecture_decode_together_and_sample_what_they_sample_alone(tiny_model_dir, dtype,
                                                                                       monkeypatch):
    tok = load_tokenizer(tiny_model_dir)
    models = [load_causal_lm(tiny_model_dir), _perturbed(load_causal_lm(tiny_model_dir), 1),
              _perturbed(load_causal_lm(tiny_model_dir), 2)]
    settings = SamplingSettings(num_generations=3, max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50)
    # Different prompt widths per agent: the fused batch pads them to one width.
    prompts = [["Hi:", "Design a playground on Mars:"],
               ["Write a long bedtime story for a dragon who cannot sleep:", "Ok:"],
               ["A", "B"]]
    keys = [[(agent, node) for node in range(2)] for agent in range(3)]
    stacks = []
    original = rollout.StackedLeanDecoder
    monkeypatch.setattr(rollout, "StackedLeanDecoder",
                        lambda decoders, **kw: stacks.append(len(decoders)) or original(decoders, **kw))
    together = rollout.sample_agents(models, [tok] * 3, prompts, settings, keys, [dtype] * 3)
    assert stacks == [3]  # one decode for all three agents
    for i in range(3):
        alone = sample_completions(models[i], tok, prompts[i], settings, keys[i], dtype)
        assert torch.equal(together[i].completion_ids, alone.completion_ids), i
        assert torch.equal(together[i].completion_mask, alone.completion_mask), i
        assert together[i].texts == alone.texts
    assert together[0].texts != together[1].texts  # the agents really have their own weights


def test_agents_of_different_architectures_are_sampled_apart(tiny_model_dir, tiny_medium_model_dir, monkeypatch):
    small, medium = load_causal_lm(tiny_model_dir), load_causal_lm(tiny_medium_model_dir)
    toks = [load_tokenizer(tiny_model_dir), load_tokenizer(tiny_medium_model_dir)]
    settings = SamplingSettings(num_generations=2, max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=50)
    prompts, keys = [["Hi:"], ["Hi:"]], [[("s",)], [("m",)]]
    stacks = []
    original = rollout.StackedLeanDecoder
    monkeypatch.setattr(rollout, "StackedLeanDecoder",
                        lambda decoders, **kw: stacks.append(len(decoders)) or original(decoders, **kw))
    together = rollout.sample_agents([small, medium], toks, prompts, settings, keys, [None, None])
    assert stacks == [1, 1]  # each agent decodes on its own
    for model, tok, got, p, k in zip([small, medium], toks, together, prompts, keys):
        assert torch.equal(got.completion_ids, sample_completions(model, tok, p, settings, k).completion_ids)


def test_agents_above_the_fusion_size_decode_apart_and_sample_the_same(tiny_model_dir, monkeypatch):
    """Large agents are not stacked (the copies would cost more than the per-call savings); the
    samples do not depend on it."""
    tok = load_tokenizer(tiny_model_dir)
    models = [load_causal_lm(tiny_model_dir), _perturbed(load_causal_lm(tiny_model_dir), 1)]
    settings = SamplingSettings(num_generations=2, max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=50)
    prompts, keys = [["Hi:", "Yo:"], ["Hey:", "A"]], [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    stacks = []
    original = rollout.StackedLeanDecoder
    monkeypatch.setattr(rollout, "StackedLeanDecoder",
                        lambda decoders, **kw: stacks.append(len(decoders)) or original(decoders, **kw))
    fused = rollout.sample_agents(models, [tok] * 2, prompts, settings, keys, [None, None])
    assert stacks == [2]
    # On the CPU its own (lower) line decides.
    monkeypatch.setattr(lean_module, "FUSE_MAX_PARAMETERS_CPU", sum(p.numel() for p in models[0].parameters()) - 1)
    apart = rollout.sample_agents(models, [tok] * 2, prompts, settings, keys, [None, None])
    assert stacks == [2, 1, 1]
    for a, b in zip(fused, apart):
        assert torch.equal(a.completion_ids, b.completion_ids)


def test_a_single_agent_decodes_on_views_of_its_weights(tiny_model_dir, monkeypatch):
    """One agent's decoder reads its (fp32) embeddings in place. Without the C decode kernels, its
    projections are reordered once per sampling call for oneDNN (CPUs with AVX-512), or copied once
    into the (in, out) layout MKL reads fastest (other CPUs), or read in place (off the CPU)."""
    monkeypatch.setattr(onednn, "MIN_WEIGHT_ELEMENTS", 0)  # pack the small model's weights too
    monkeypatch.setattr(onednn, "FP32_THROUGH_ONEDNN", True)  # and fp32 ones on a CPU without AVX-512
    monkeypatch.setattr(decode_kernels, "runs", lambda tensor: False)  # where the C kernels would take them
    model = load_causal_lm(tiny_model_dir)
    o_proj = model.model.layers[0].self_attn.o_proj.weight
    decoder = StackedLeanDecoder([lean_decoder_for(model)])
    assert decoder.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if onednn.AVAILABLE:
        assert decoder.layers[0].o.packed and len(decoder.layers[0].o.linears) == 1
        assert decoder.layers[0].o.linears[0].weight.is_mkldnn
    monkeypatch.setattr(onednn, "AVAILABLE", False)
    decoder = StackedLeanDecoder([lean_decoder_for(model)])
    assert not decoder.layers[0].o.packed
    weight = decoder.layers[0].o.weight
    assert weight.is_contiguous() and torch.equal(weight, o_proj.detach().t().unsqueeze(0))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_and_batched_projections_decode_the_same_tokens(tiny_model_dir, dtype, monkeypatch):
    """The CPU's oneDNN-packed projections and the stacked batched-matmul path sample the same
    completions (their sums round differently in fp32, by ~1e-6 relative), fused or alone."""
    if not onednn.AVAILABLE:
        pytest.skip("this torch build has no oneDNN")
    if dtype is not None and not onednn.BF16_AVAILABLE:
        pytest.skip("oneDNN has no bf16 kernels on this CPU: bf16 weights stay unpacked (needs AVX-512 or AMX)")
    monkeypatch.setattr(onednn, "MIN_WEIGHT_ELEMENTS", 0)  # pack the small model's weights too
    monkeypatch.setattr(onednn, "FP32_THROUGH_ONEDNN", True)  # and fp32 ones on a CPU without AVX-512
    monkeypatch.setattr(decode_kernels, "runs", lambda tensor: False)  # where the C kernels would take them
    tok = load_tokenizer(tiny_model_dir)
    models = [load_causal_lm(tiny_model_dir), _perturbed(load_causal_lm(tiny_model_dir), 1)]
    settings = SamplingSettings(num_generations=3, max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50)
    prompts, keys = [["Hi:", "Design a playground on Mars:"], ["Ok:", "A"]], [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    packed = rollout.sample_agents(models, [tok] * 2, prompts, settings, keys, [dtype] * 2)
    monkeypatch.setattr(onednn, "AVAILABLE", False)
    batched = rollout.sample_agents(models, [tok] * 2, prompts, settings, keys, [dtype] * 2)
    for a, b in zip(packed, batched):
        assert torch.equal(a.completion_ids, b.completion_ids)


def test_architectures_the_lean_paths_do_not_reproduce_are_left_to_the_model():
    """Sliding-window attention and other activations than SiLU fall back to the model's forward."""
    assert supports_lean_path(tiny(MistralConfig, sliding_window=None))
    assert not supports_lean_path(tiny(MistralConfig, sliding_window=16))
    assert not supports_lean_path(tiny(LlamaConfig, hidden_act="gelu"))
    qwen_windowed = tiny(Qwen2Config, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert "sliding_attention" in qwen_windowed.config.layer_types
    assert not supports_lean_path(qwen_windowed)


@pytest.mark.parametrize("eos_share", [0.0, 0.6], ids=["no-early-stop", "rows-stop-early"])
def test_fixed_shape_decode_samples_what_the_step_by_step_loop_samples(tiny_medium_model_dir, monkeypatch, eos_share):
    """The CUDA-graph decode's fixed-shape steps (every cache column read, unwritten ones masked,
    finish read back every few steps), run eagerly on the CPU: the same tokens and the same number
    of columns as the step-by-step loop. With many EOS ids the rows stop at different steps and the
    whole batch stops early."""
    model = load_causal_lm(tiny_medium_model_dir)
    tok = load_tokenizer(tiny_medium_model_dir)
    if eos_share:
        model.generation_config.eos_token_id = list(range(int(eos_share * 256)))
    settings = SamplingSettings(num_generations=4, max_new_tokens=24, temperature=0.8, top_p=0.9, top_k=50)
    prompts, keys = ["Hi:", "A longer prompt:"], [(0,), (1,)]
    step_by_step = sample_completions(model, tok, prompts, settings, keys)
    fixed_shape_runs = []
    original = rollout._graphed_decode
    monkeypatch.setattr(rollout, "use_cuda_graphs", lambda device, max_new: True)
    monkeypatch.setattr(rollout, "_graphed_decode",
                        lambda *a, **kw: fixed_shape_runs.append(kw) or original(*a, **kw))
    fixed_shape = sample_completions(model, tok, prompts, settings, keys)
    assert fixed_shape_runs == [{"capture": False}]
    assert torch.equal(fixed_shape.completion_ids, step_by_step.completion_ids)
    assert torch.equal(fixed_shape.completion_mask, step_by_step.completion_mask)
    if eos_share:
        lengths = step_by_step.completion_mask.sum(dim=1)
        assert step_by_step.completion_ids.shape[1] < settings.max_new_tokens and len(set(lengths.tolist())) > 1
    else:
        assert step_by_step.completion_ids.shape[1] == settings.max_new_tokens


def test_cuda_graphs_are_used_only_on_cuda_devices(monkeypatch):
    assert rollout.use_cuda_graphs(torch.device("cuda", 0), 64)
    assert not rollout.use_cuda_graphs(torch.device("cpu"), 64)
    assert not rollout.use_cuda_graphs(torch.device("cuda", 0), rollout.CUDA_GRAPH_MIN_NEW_TOKENS - 1)
    monkeypatch.setenv("COMLRL_CUDA_GRAPHS", "0")
    assert not rollout.use_cuda_graphs(torch.device("cuda", 0), 64)


@pytest.mark.parametrize("nbytes", [3 * 1024, 5 * pages.HUGE_PAGE_BYTES + 100])
def test_an_arena_hands_out_zeroed_aligned_tensors_that_outlive_it(nbytes):
    """The decode cache's memory (`pages.Arena`): zeroed, each tensor cache-line aligned, the large
    arena on a huge-page boundary (its own mapping), asking past its size refused, and the tensors
    stay valid after the arena object is gone (they keep the mapping)."""
    arena = pages.Arena(nbytes)
    first = arena.take(3, 5, dtype=torch.float32)
    second = arena.take((nbytes - 200) // 8 - 8, dtype=torch.float64)
    assert first.data_ptr() % pages.ALIGN == 0 and second.data_ptr() % pages.ALIGN == 0
    assert second.data_ptr() >= first.data_ptr() + first.numel() * 4
    if nbytes >= pages.HUGE_PAGE_BYTES and hasattr(pages.mmap, "MADV_HUGEPAGE"):
        assert first.data_ptr() % pages.HUGE_PAGE_BYTES == 0
    assert not first.any() and not second.any()
    with pytest.raises(ValueError, match="more bytes asked"):
        arena.take(64, dtype=torch.float32)
    del arena
    second.fill_(2.5)
    assert float(second.sum()) == 2.5 * second.numel()
