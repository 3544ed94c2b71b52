"""The lean training forward computes the transformers forward's log-probs and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from comlrl.losses import _transformers_shared_prompt_logits, completion_mask, shared_prompt_token_logprobs
from comlrl.models import decode_kernels, onednn, training_ops
from comlrl.models.lean import shared_prompt_logits
from comlrl.precision import autocast, training_attention

CPU = torch.device("cpu")
EOS = 5


def tiny(config_cls, **extra):
    torch.manual_seed(0)
    settings = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config_cls(**{**settings, **extra})).train()
    with torch.no_grad():  # biases start at zero, where leaving one out would go unnoticed
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(std=0.5)
    return model


MODELS = {"qwen2-gqa": lambda: tiny(Qwen2Config), "llama-gqa": lambda: tiny(LlamaConfig),
          "llama-mha": lambda: tiny(LlamaConfig, num_key_value_heads=4),
          "llama-biases": lambda: tiny(LlamaConfig, attention_bias=True, mlp_bias=True),
          "mistral": lambda: tiny(MistralConfig, sliding_window=None)}


def _batch(steps: int, k: int = 3):
    """Two prompts (the first left-padded by two) and K completions each, one ending early at EOS."""
    torch.manual_seed(1)
    prompt_ids = torch.randint(0, 97, (2, 6))
    prompt_mask = torch.ones(2, 6, dtype=torch.long)
    prompt_mask[0, :2] = 0
    completions = torch.randint(6, 97, (2 * k, steps))
    if steps > 4:
        completions[1, 4] = EOS
    return prompt_ids, prompt_mask, completions, completion_mask(completions, [EOS]), k


def _both(model, steps, dtype):
    prompt_ids, prompt_mask, completions, mask, k = _batch(steps)
    lean = shared_prompt_logits(model, prompt_ids, prompt_mask, completions, k, dtype)
    with training_attention(model, CPU, dtype), autocast(CPU, dtype):
        reference = _transformers_shared_prompt_logits(model, prompt_ids, prompt_mask, completions, mask, k)
    trained = mask.unsqueeze(-1)  # positions after the first EOS are never trained
    params = list(model.parameters())
    lean_grads = torch.autograd.grad((lean * trained).sum(), params)
    reference_grads = torch.autograd.grad((reference * trained).sum(), params)
    return lean * trained, reference * trained, lean_grads, reference_grads


@pytest.mark.parametrize("products", ["f-linear", "onednn"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("steps", [9, 1])
@pytest.mark.parametrize("elementwise", ["c-kernels", "torch"])
def test_lean_forward_matches_the_model_in_fp32(name, steps, products, elementwise, monkeypatch):
    """fp32 projections run through `F.linear` (small weights, as here) or oneDNN (forced here); the
    attention, norms and rotary embedding through the C kernels (`decode_kernels`, where they run
    here) or torch ops."""
    if elementwise == "c-kernels":
        if not decode_kernels.runs(torch.zeros(1)):
            pytest.skip("the C kernels do not run here")
        calls, fused = [], training_ops.shared_prefix_attention
        monkeypatch.setattr(training_ops, "shared_prefix_attention", lambda *a: calls.append(1) or fused(*a))
    else:
        monkeypatch.setattr(decode_kernels, "runs", lambda tensor: False)
    if products == "onednn":
        if not onednn.AVAILABLE:
            pytest.skip("this torch build has no oneDNN")
        monkeypatch.setattr(onednn, "MIN_WEIGHT_ELEMENTS", 0)
        monkeypatch.setattr(onednn, "FP32_THROUGH_ONEDNN", True)  # also on a CPU without AVX-512
    lean, reference, lean_grads, reference_grads = _both(MODELS[name](), steps, None)
    assert lean.shape == reference.shape == (6, steps, 97)
    if elementwise == "c-kernels":
        assert calls, "the fp32 forward did not run the fused attention"
    assert torch.allclose(lean, reference, atol=1e-5, rtol=1e-5)
    for a, b in zip(lean_grads, reference_grads):
        # fp32 rounding: sums run in another order (cancelling ones, e.g. key-bias gradients, lose
        # the most), so the bound is relative to the largest entry of the gradient
        assert torch.allclose(a, b, atol=5e-5 * float(b.abs().max()), rtol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_lean_forward_matches_the_autocast_model_in_bf16_to_bf16_rounding(name):
    lean, reference, lean_grads, reference_grads = _both(MODELS[name](), 9, torch.bfloat16)
    assert lean.dtype == torch.float32
    assert torch.allclose(lean, reference, atol=2e-2)
    for a, b in zip(lean_grads, reference_grads):
        assert float((a - b).abs().max()) <= 5e-2 * float(b.abs().max())


def test_unsupported_settings_fall_back_to_the_model_forward():
    """Attention dropout while training is not reproduced: the loss runs the model's own forward."""
    model = tiny(Qwen2Config, attention_dropout=0.5)
    prompt_ids, prompt_mask, completions, mask, k = _batch(4)
    assert shared_prompt_logits(model, prompt_ids, prompt_mask, completions, k) is None
    torch.manual_seed(3)
    logprobs = shared_prompt_token_logprobs(model, prompt_ids, prompt_mask, completions, mask, k)
    assert logprobs.shape == (6, 4) and bool((logprobs <= 0).all())
    model.eval()  # no dropout at evaluation: the lean forward applies
    assert shared_prompt_logits(model, prompt_ids, prompt_mask, completions, k) is not None
