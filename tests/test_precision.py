"""Mixed precision (bf16 autocast) and the bucketed sequence widths that keep its CPU kernels few."""

from __future__ import annotations

import pytest
import torch

from comlrl.data import story_prompts
from comlrl.losses import WIDTH_BUCKETS, bucketed_width, width_buckets
from comlrl.models import onednn
from comlrl.models import load_causal_lm, load_tokenizer
from comlrl.precision import compute_dtype, training_attention
from comlrl.rewards import length_ratio_reward
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

CPU = torch.device("cpu")


def make_trainer(model_dir, **config):
    settings = dict(num_turns=1, num_train_epochs=2, num_generations=4, max_new_tokens=12, logging_steps=1,
                    show_progress=False, agent_learning_rate=1e-3, mixed_precision="bf16")
    settings.update(config)
    return MAGRPOTrainer(agents=[load_causal_lm(model_dir) for _ in range(2)], tokenizer=load_tokenizer(model_dir),
                         reward_func=length_ratio_reward, train_dataset=story_prompts(), args=MAGRPOConfig(**settings))


def weights(trainer):
    return [{name: p.detach().clone() for name, p in agent.named_parameters()} for agent in trainer.agents]


def test_compute_dtype_resolution():
    assert compute_dtype("no", CPU) is None
    assert compute_dtype("auto", CPU) is None  # the CPU stays exact unless asked
    assert compute_dtype("bf16", CPU) is torch.bfloat16
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        compute_dtype("fp16", CPU)
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        MAGRPOConfig(mixed_precision="fp8")


def test_bf16_on_a_cpu_without_native_bf16_warns_that_fp32_is_faster(monkeypatch):
    import warnings

    import comlrl.precision as precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(UserWarning, match="no native bf16 instructions"):
        assert compute_dtype("bf16", CPU) is torch.bfloat16  # still honoured: the numbers are bf16's
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compute_dtype("bf16", CPU) is torch.bfloat16
        assert compute_dtype("no", CPU) is None


def test_bucketed_widths():
    assert [bucketed_width(w, 10_000) for w in (1, 8, 9, 63, 64, 65)] == [8, 8, 16, 64, 64, 72]
    coarse = [bucketed_width(w, 10_000, "coarse") for w in (1, 8, 9, 12, 13, 17, 25, 33, 49, 63, 65, 97)]
    assert coarse == [8, 8, 12, 12, 16, 24, 32, 48, 64, 64, 96, 128]
    assert [bucketed_width(w, 10_000, "exact") for w in (1, 9, 37, 65)] == [1, 9, 37, 65]
    for buckets in WIDTH_BUCKETS:
        assert bucketed_width(70, 66, buckets) == 66  # never past the data
    for width in range(1, 600):  # a bucket holds the width, at most half again as wide (or 8)
        assert width <= bucketed_width(width, 10_000, "coarse") <= max(8, width * 3 // 2)
    with pytest.raises(ValueError, match="buckets must be one of"):
        bucketed_width(10, 100, "wide")


def test_width_buckets_pad_only_where_products_cache_kernels_per_shape(monkeypatch):
    assert width_buckets(torch.device("cuda"), torch.float32) == "fine"
    for through_onednn, expected in ((True, "coarse"), (False, "exact")):
        monkeypatch.setattr(onednn, "FP32_THROUGH_ONEDNN", through_onednn)
        assert width_buckets(CPU, torch.float32) == expected
    monkeypatch.setattr(onednn, "AVAILABLE", True)
    assert width_buckets(CPU, torch.bfloat16) == "coarse"
    monkeypatch.setattr(onednn, "AVAILABLE", False)
    assert width_buckets(CPU, torch.bfloat16) == "exact"


def test_training_attention_switches_only_for_cpu_bf16_and_restores(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    assert model.config._attn_implementation == "sdpa"
    with training_attention(model, CPU, None):
        assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"):
        with training_attention(model, CPU, torch.bfloat16):
            assert model.config._attn_implementation == "eager"
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_bf16_training_keeps_fp32_weights_and_moves_them(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, num_train_epochs=1)
    before = weights(trainer)
    trainer.train()
    after = weights(trainer)
    for agent_before, agent_after in zip(before, after):
        assert all(value.dtype == torch.float32 for value in agent_after.values())
        changed = [name for name in agent_before if not torch.equal(agent_before[name], agent_after[name])]
        assert len(changed) == len(agent_before)  # every tensor got an update, none was rounded away
    for optimizer in trainer.optimizers:
        assert all(state["exp_avg"].dtype == torch.float32 for state in optimizer.state.values())


def test_bf16_run_is_deterministic_and_resumes_exactly(tiny_model_dir, tmp_path):
    straight = make_trainer(tiny_model_dir)
    straight.train()
    again = make_trainer(tiny_model_dir)
    again.train()
    first_half = make_trainer(tiny_model_dir, num_train_epochs=1)
    first_half.train(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=1)
    resumed = make_trainer(tiny_model_dir)
    resumed.train(resume_from_checkpoint=str(tmp_path / "ckpt" / "checkpoint-1"), checkpoint_dir=str(tmp_path / "ckpt"))
    for want, got, repeat in zip(weights(straight), weights(resumed), weights(again)):
        for name in want:
            assert torch.equal(want[name], repeat[name]), name
            assert torch.equal(want[name], got[name]), name


def test_bf16_resume_of_an_fp32_run_is_refused(tiny_model_dir, tmp_path):
    make_trainer(tiny_model_dir, num_train_epochs=1, mixed_precision="no").train(
        checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=1)
    with pytest.raises(ValueError, match="mixed_precision"):
        make_trainer(tiny_model_dir).train(resume_from_checkpoint=str(tmp_path / "ckpt" / "checkpoint-1"),
                                           checkpoint_dir=str(tmp_path / "ckpt"))
