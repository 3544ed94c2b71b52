"""The trainer on a CUDA device: learning in fp32 and bf16, exact resume, agents split across a GPU
and the CPU, and sampling by CUDA graph replay. They run under `pytest -m gpu` (`make test` runs
that where a GPU is present; the rest of the suite hides GPUs, see conftest) and are skipped
without one (CI has none).

CUDA kernels that accumulate with atomics (embedding backward, index_add) sum in a different order
on every call, so bit-exact resume on a GPU needs `torch.use_deterministic_algorithms(True)`: the
resume tests switch it on, as a researcher who needs exactness would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from comlrl.data import story_prompts
from comlrl.models import load_causal_lm, load_tokenizer
from comlrl import rollout
from comlrl.rewards import length_ratio_reward
from comlrl.rollout import SamplingSettings, sample_completions
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

# cuBLAS reads this when its first handle is made; deterministic mode refuses to run without it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def build_trainer(model_dir, devices, metrics_path=None, **config):
    settings = dict(num_turns=1, num_train_epochs=1, num_generations=4, max_new_tokens=16, logging_steps=1,
                    show_progress=False, agent_devices=devices)
    settings.update(config)
    return MAGRPOTrainer(
        agents=[load_causal_lm(model_dir) for _ in range(2)],
        tokenizer=load_tokenizer(model_dir),
        reward_func=length_ratio_reward,
        train_dataset=story_prompts(),
        args=MAGRPOConfig(**settings),
        metrics_path=metrics_path,
    )


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def final_parameters(trainer) -> list[dict]:
    return [{name: p.detach().cpu().clone() for name, p in agent.named_parameters()} for agent in trainer.agents]


@pytest.mark.parametrize("mixed_precision", ["no", "auto"])
def test_reward_rises_on_the_gpu(tiny_model_dir, tmp_path, mixed_precision):
    """'auto' is bf16 products on a GPU that supports them (fp32 weights and AdamW state)."""
    metrics = tmp_path / "metrics.jsonl"
    trainer = build_trainer(tiny_model_dir, "cuda:0", str(metrics), num_train_epochs=20, agent_learning_rate=3e-3,
                            mixed_precision=mixed_precision)
    trainer.train()
    assert all(p.device.type == "cuda" for agent in trainer.agents for p in agent.parameters())
    assert all(p.dtype == torch.float32 for agent in trainer.agents for p in agent.parameters())
    rewards = [r["turn_1/reward_mean"] for r in rows(metrics)]
    assert len(rewards) == 40
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, (first, last)


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cuda:0", "cpu"]], ids=["gpu", "gpu+cpu"])
def test_resume_on_the_gpu_is_exact(tiny_medium_model_dir, tmp_path, deterministic, devices):
    """Stop after epoch 1 of 3 and resume in a new trainer: weights torch.equal to the uninterrupted
    run's, and the same logged rows. With one agent on the CPU the two agents sample concurrently."""
    settings = dict(num_train_epochs=3, agent_learning_rate=1e-3, mixed_precision="auto")
    straight = build_trainer(tiny_medium_model_dir, devices, str(tmp_path / "straight.jsonl"), **settings)
    straight.train()
    want = final_parameters(straight)

    checkpoints = tmp_path / "checkpoints"
    first = build_trainer(tiny_medium_model_dir, devices, str(tmp_path / "resumed.jsonl"),
                          **{**settings, "num_train_epochs": 1})
    first.train(checkpoint_dir=str(checkpoints))
    resumed = build_trainer(tiny_medium_model_dir, devices, str(tmp_path / "resumed.jsonl"), **settings)
    resumed.train(checkpoint_dir=str(checkpoints), resume_from_checkpoint="auto")
    got = final_parameters(resumed)

    assert resumed.devices == [torch.device(d) for d in devices]
    assert resumed._concurrent_rollout == (len(set(devices)) > 1)
    for i, (w, g) in enumerate(zip(want, got)):
        changed = any(not torch.equal(w[name], p.detach().cpu())
                      for name, p in load_causal_lm(tiny_medium_model_dir).named_parameters())
        assert changed, f"agent {i} did not train"
        for name in w:
            assert torch.equal(w[name], g[name]), f"agent {i} {name} differs after resume"
    assert rows(tmp_path / "straight.jsonl") == rows(tmp_path / "resumed.jsonl")


@pytest.mark.parametrize("eos_share", [0.0, 0.6], ids=["no-early-stop", "rows-stop-early"])
def test_graphed_decode_samples_what_its_eager_steps_sample(tiny_medium_model_dir, monkeypatch, recwarn, eos_share):
    """Sampling on the GPU replays each decode step as a CUDA graph: the tokens equal those of the
    same fixed-shape steps run eagerly, in fp32 and bf16; in fp32 also those of the step-by-step
    loop (COMLRL_CUDA_GRAPHS=0). With many EOS ids rows stop at different steps and the batch early."""
    model = load_causal_lm(tiny_medium_model_dir).to("cuda")
    tok = load_tokenizer(tiny_medium_model_dir)
    if eos_share:
        model.generation_config.eos_token_id = list(range(int(eos_share * 256)))
    settings = SamplingSettings(num_generations=4, max_new_tokens=32, temperature=0.8, top_p=0.9, top_k=50)
    prompts, keys = ["Hi:", "A longer prompt:", "C"], [(0,), (1,), (2,)]
    original = rollout._graphed_decode
    for dtype in (None, torch.bfloat16):
        captures = []
        with monkeypatch.context() as patch:
            patch.setattr(rollout, "_graphed_decode", lambda *a, **kw: captures.append(kw["capture"]) or original(*a, **kw))
            graphed = sample_completions(model, tok, prompts, settings, keys, compute_dtype=dtype)
        with monkeypatch.context() as patch:
            patch.setattr(rollout, "_graphed_decode", lambda *a, **kw: original(*a, **{**kw, "capture": False}))
            eager = sample_completions(model, tok, prompts, settings, keys, compute_dtype=dtype)
        assert captures == [True]
        assert torch.equal(graphed.completion_ids, eager.completion_ids), dtype
        assert torch.equal(graphed.completion_mask, eager.completion_mask), dtype
        if dtype is None:
            with monkeypatch.context() as patch:
                patch.setenv("COMLRL_CUDA_GRAPHS", "0")
                step_by_step = sample_completions(model, tok, prompts, settings, keys)
            assert torch.equal(graphed.completion_ids, step_by_step.completion_ids)
        if eos_share:
            assert graphed.completion_ids.shape[1] < settings.max_new_tokens
    assert not [w for w in recwarn if "CUDA graph" in str(w.message)]
