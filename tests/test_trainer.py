"""Trainer behaviour in-process: learning, agent counts, reward forms, errors that lose nothing."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from comlrl.data import story_prompts
from comlrl.models import load_causal_lm, load_tokenizer
from comlrl.rewards import length_ratio_reward
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.utils import CheckpointError, find_latest_checkpoint


@pytest.fixture
def make_trainer(tiny_model_dir):
    def build(num_agents=2, reward=length_ratio_reward, dataset=None, metrics_path=None, **config):
        settings = dict(num_turns=1, num_train_epochs=1, num_generations=2, max_new_tokens=8, logging_steps=1,
                        show_progress=False)
        settings.update(config)
        return MAGRPOTrainer(
            agents=[load_causal_lm(tiny_model_dir) for _ in range(num_agents)],
            tokenizer=load_tokenizer(tiny_model_dir),
            reward_func=reward,
            train_dataset=dataset if dataset is not None else story_prompts(),
            args=MAGRPOConfig(**settings),
            metrics_path=metrics_path,
        )
    return build


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------- learning

@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_reward_rises_on_the_length_ratio_task(make_trainer, tmp_path, mixed_precision):
    """Fixed seed; the mean reward of the last quarter of updates clearly beats the first quarter,
    in fp32 and with bf16 products (fp32 weights)."""
    metrics = tmp_path / "metrics.jsonl"
    trainer = make_trainer(num_train_epochs=20, num_generations=4, max_new_tokens=16, agent_learning_rate=3e-3,
                           metrics_path=str(metrics), mixed_precision=mixed_precision)
    trainer.train()
    rewards = [r["turn_1/reward_mean"] for r in rows(metrics)]
    assert len(rewards) == 40
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, (first, last)


# ------------------------------------------------------------------------------ agents and forms

def test_three_agents_with_a_three_argument_reward(make_trainer, tmp_path):
    calls = []

    def three_way(c1, c2, c3):
        calls.append(len(c1))
        return [float(len(a) + len(b) - len(c)) for a, b, c in zip(c1, c2, c3)]

    trainer = make_trainer(num_agents=3, reward=three_way, metrics_path=str(tmp_path / "m.jsonl"))
    trainer.train()
    assert len(trainer.agents) == 3
    # once per batch of joint actions: 2 prompts x K=2 per update, 2 updates
    assert calls == [4, 4]
    assert [r["env_step"] for r in rows(tmp_path / "m.jsonl")] == [4, 8]
    assert "agent_2/loss" in rows(tmp_path / "m.jsonl")[0]


def test_cross_mode_scores_all_combinations(make_trainer, tmp_path):
    seen = []

    def reward(completions1, completions2):
        seen.append(len(completions1))
        return [0.0] * len(completions1)

    make_trainer(reward=reward, joint_mode="cross", num_generations=3, metrics_path=str(tmp_path / "m.jsonl")).train()
    assert seen == [2 * 9, 2 * 9]  # 2 prompts x 3^2 combinations
    assert [r["env_step"] for r in rows(tmp_path / "m.jsonl")] == [18, 36]


@pytest.mark.parametrize("form", ["prompts_first", "varargs", "keyword", "batch_items"])
def test_reward_forms(make_trainer, form):
    got = {}

    def prompts_first(prompts, completions1, completions2):
        got.setdefault("prompts", prompts)
        return [1.0] * len(prompts)

    def varargs(*completions):
        got["n"] = len(completions)
        return [1.0] * len(completions[0])

    def keyword(*, completions, prompts=None):
        got["n"] = len(completions)
        return [1.0] * len(prompts)

    def batch_items(completions1, completions2, batch_items=None):
        got.setdefault("items", batch_items)
        return [1.0] * len(completions1)

    fn = {"prompts_first": prompts_first, "varargs": varargs, "keyword": keyword, "batch_items": batch_items}[form]
    make_trainer(reward=fn).train()
    if form == "prompts_first":
        assert got["prompts"][0] == "Describe a city in the clouds:" and len(got["prompts"]) == 4
    elif form == "batch_items":
        assert got["items"][0]["prompt"] == "Describe a city in the clouds:"
    else:
        assert got["n"] == 2


def test_heterogeneous_agents_and_one_tokenizer_each(tiny_model_dir, tiny_medium_model_dir):
    trainer = MAGRPOTrainer(
        agents=[load_causal_lm(tiny_model_dir), load_causal_lm(tiny_medium_model_dir)],
        tokenizer=[load_tokenizer(tiny_model_dir), load_tokenizer(tiny_medium_model_dir)],
        reward_func=length_ratio_reward, train_dataset=story_prompts(),
        args=MAGRPOConfig(num_turns=1, num_train_epochs=1, num_generations=2, max_new_tokens=4, show_progress=False),
    )
    before = [p.detach().clone() for p in trainer.agents[1].parameters()]
    trainer.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.agents[1].parameters()))


# ------------------------------------------------------------------------ errors that lose nothing

@pytest.fixture
def finished_run(make_trainer, tmp_path):
    """A 2-epoch run with checkpoint-1 and checkpoint-2 on disk."""
    checkpoints = tmp_path / "checkpoints"
    make_trainer(num_train_epochs=2).train(checkpoint_dir=str(checkpoints))
    return checkpoints


@pytest.mark.parametrize("bad, message", [
    (lambda c1, c2: [1.0] * (len(c1) - 1), r"returned 3 rewards for 4 joint actions"),
    (lambda c1, c2: [float("nan")] * len(c1), r"returned nan at index 0"),
    (lambda c1, c2: [1.0, float("inf")] + [0.0] * (len(c1) - 2), r"returned inf at index 1"),
    (lambda c1, c2: 1 / 0, r"raised ZeroDivisionError"),
    (lambda c1, c2: "good", r"returned str"),
])
def test_bad_reward_outputs_name_the_function(make_trainer, finished_run, bad, message):
    before = tree_digest(finished_run)
    trainer = make_trainer(reward=bad, num_train_epochs=3, allow_resume_drift=["reward_func"])
    with pytest.raises((ValueError, RuntimeError), match=message) as info:
        trainer.train(checkpoint_dir=str(finished_run), resume_from_checkpoint="auto")
    assert "<lambda>" in str(info.value)
    assert tree_digest(finished_run) == before


def test_drifted_config_on_resume_lists_every_changed_key(make_trainer, finished_run):
    before = tree_digest(finished_run)
    trainer = make_trainer(num_train_epochs=4, temperature=0.9, agent_learning_rate=1e-3)
    with pytest.raises(ValueError) as info:
        trainer.train(checkpoint_dir=str(finished_run), resume_from_checkpoint="auto")
    text = str(info.value)
    assert "temperature: checkpoint 0.6 -> now 0.9" in text and "agent_learning_rate" in text
    assert "Nothing was written" in text and "num_train_epochs" not in text.split("\n")[1]
    assert tree_digest(finished_run) == before


def test_drifted_reward_function_and_dataset_are_refused(make_trainer, finished_run):
    before = tree_digest(finished_run)

    def other_reward(completions1, completions2):
        return [0.0] * len(completions1)

    shuffled = Dataset.from_dict({"prompt": list(reversed(story_prompts()["prompt"]))})
    with pytest.raises(ValueError) as info:
        make_trainer(reward=other_reward, dataset=shuffled, num_train_epochs=3).train(
            checkpoint_dir=str(finished_run), resume_from_checkpoint="auto")
    assert "fingerprint reward_func" in str(info.value) and "fingerprint train_dataset" in str(info.value)
    assert tree_digest(finished_run) == before


def test_escape_hatch_allows_a_deliberate_change(make_trainer, finished_run):
    trainer = make_trainer(num_train_epochs=3, temperature=0.9, allow_resume_drift=["temperature"])
    trainer.train(checkpoint_dir=str(finished_run), resume_from_checkpoint="auto")
    assert (finished_run / "checkpoint-3").is_dir()


def test_checkpoint_past_num_train_epochs(make_trainer, finished_run):
    before = tree_digest(finished_run)
    with pytest.raises(ValueError, match="already completed 2 epochs, more than num_train_epochs=1"):
        make_trainer(num_train_epochs=1).train(checkpoint_dir=str(finished_run),
                                               resume_from_checkpoint=str(finished_run / "checkpoint-2"))
    assert tree_digest(finished_run) == before


def test_finished_run_with_same_epochs_does_nothing(make_trainer, finished_run):
    before = tree_digest(finished_run)
    summary = make_trainer(num_train_epochs=2).train(checkpoint_dir=str(finished_run), resume_from_checkpoint="auto")
    assert summary["env_step"] == 16 and tree_digest(finished_run) == before


def test_fresh_run_refuses_another_runs_checkpoint_dir(make_trainer, finished_run):
    before = tree_digest(finished_run)
    with pytest.raises(ValueError, match="already holds checkpoints of another run"):
        make_trainer(num_train_epochs=2).train(checkpoint_dir=str(finished_run))
    assert tree_digest(finished_run) == before


def test_missing_checkpoint_path(make_trainer, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_trainer().train(resume_from_checkpoint=str(tmp_path / "nope"))


def test_torn_checkpoint_is_skipped_for_latest_and_refused_by_name(make_trainer, finished_run):
    weights = finished_run / "checkpoint-2" / "agent_0" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.warns(UserWarning, match="Skipping damaged checkpoint .*checkpoint-2.*truncated"):
        assert find_latest_checkpoint(finished_run).name == "checkpoint-1"
    with pytest.raises(CheckpointError, match=r"agent_0/model.safetensors is truncated"):
        make_trainer(num_train_epochs=3).train(checkpoint_dir=str(finished_run),
                                               resume_from_checkpoint=str(finished_run / "checkpoint-2"))
    (finished_run / "checkpoint-1" / "manifest.json").unlink()  # as if the write died before the manifest
    with pytest.warns(UserWarning, match="manifest.json is missing"):
        assert find_latest_checkpoint(finished_run) is None


def test_unwritable_checkpoint_dir(make_trainer, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(PermissionError, match="not writable"):
        make_trainer().train(checkpoint_dir=str(blocker / "checkpoints"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_generations=1), "num_generations must be >= 2"),
    (dict(joint_mode="crossed"), "joint_mode must be one of"),
    (dict(advantage_mode="median"), "advantage_mode must be one of"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(mixed_precision="fp16"), "mixed_precision must be one of"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MAGRPOConfig(**kwargs)


def test_unknown_config_key_is_a_type_error():
    with pytest.raises(TypeError, match="unknown setting.*'num_generation' \\(did you mean 'num_generations'\\?\\)"):
        MAGRPOConfig(num_generation=4)


def test_dataset_errors(make_trainer):
    with pytest.raises(ValueError, match="no field 'prompt'.*fields: \\['text'\\]"):
        make_trainer(dataset=Dataset.from_dict({"text": ["a"]}))
    with pytest.raises(ValueError, match="train_dataset is empty"):
        make_trainer(dataset=Dataset.from_dict({"prompt": []}))


def test_multi_turn_default_needs_a_transition(make_trainer):
    with pytest.raises(ValueError, match="num_turns=2 needs an external_transition"):
        make_trainer(num_turns=2)


def test_wrong_reward_arity(make_trainer):
    with pytest.raises(TypeError, match="but there are 3 agents"):
        make_trainer(num_agents=3, reward=length_ratio_reward)


def test_completions_are_recorded_with_each_logged_row(tiny_model_dir, tmp_path):
    from comlrl.wandb_offline import find_offline_runs

    trainer = MAGRPOTrainer(
        agents=[load_causal_lm(tiny_model_dir) for _ in range(2)], tokenizer=load_tokenizer(tiny_model_dir),
        reward_func=length_ratio_reward, train_dataset=story_prompts(),
        args=MAGRPOConfig(num_turns=1, num_train_epochs=1, num_generations=2, max_new_tokens=6, logging_steps=1,
                          log_completions=3, show_progress=False),
        metrics_path=str(tmp_path / "metrics.jsonl"),
        wandb_config={"project": "completions", "dir": str(tmp_path), "mode": "offline"},
    )
    trainer.train()
    samples = rows(tmp_path / "completions.jsonl")
    assert [s["env_step"] for s in samples] == [4, 4, 4, 8, 8, 8]
    first = samples[0]
    assert first["prompt"] == "Describe a city in the clouds:" and first["turn"] == 1
    assert len(first["completions"]) == 2 and all(isinstance(c, str) for c in first["completions"])
    assert first["reward"] == pytest.approx(length_ratio_reward([first["completions"][0]], [first["completions"][1]])[0])
    import wandb

    wandb.teardown()  # finish() can return before the offline file is complete
    history = find_offline_runs(tmp_path / "wandb")[0].history
    assert len(history) == 2
    assert all(row["completions._type"] == "table-file" and row["completions.nrows"] == 3 for row in history)


def test_chunked_forward_accumulates_the_same_gradient(make_trainer):
    """max_forward_tokens only changes how the minibatch is cut into forwards: one row per chunk and
    one chunk for all rows train to the same weights up to float rounding (same keyed samples)."""
    results = []
    for budget in (1, 1_000_000):
        trainer = make_trainer(num_generations=4, max_new_tokens=12, agent_learning_rate=1e-3, max_forward_tokens=budget)
        trainer.train()
        results.append([dict(agent.named_parameters()) for agent in trainer.agents])
    for one_row, one_chunk in zip(*results):
        for name, value in one_row.items():
            assert torch.allclose(value, one_chunk[name], atol=2e-6), name


def test_concurrent_rollout_gives_the_same_run(make_trainer, tmp_path):
    """Agents on different devices sample in one thread each; on CPU the same path is forced here and
    must reproduce the sequential run exactly (samples are keyed, not order-dependent)."""
    finals = []
    for concurrent in (False, True):
        trainer = make_trainer(metrics_path=str(tmp_path / f"{concurrent}.jsonl"), agent_learning_rate=1e-3)
        trainer._concurrent_rollout = concurrent
        trainer.train()
        trainer.close()
        finals.append([dict(agent.named_parameters()) for agent in trainer.agents])
    for sequential, threaded in zip(*finals):
        for name, value in sequential.items():
            assert torch.equal(value, threaded[name]), name
    assert rows(tmp_path / "False.jsonl") == rows(tmp_path / "True.jsonl")


def test_the_cpu_suite_runs_with_gpus_hidden():
    """conftest hides GPUs outside `pytest -m gpu`, so on a GPU machine these tests (and their
    subprocesses) check the CPU's guarantees, with the trainer on the CPU as in CI."""
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert not torch.cuda.is_available()


def test_gradient_buffers_are_kept_but_unused_parameters_are_not_stepped():
    """Gradient buffers are allocated up front and zeroed in place between minibatches (reused), yet a
    parameter the loss did not use is skipped by the optimizer, as with gradients set to None:
    AdamW would otherwise move it by its momentum on a zero gradient."""
    from comlrl.trainers.reinforce import magrpo

    used, sometimes = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    optimizer = torch.optim.AdamW([used, sometimes, frozen], lr=0.1)
    gradients = magrpo._GradientBuffers([optimizer])  # as the trainer does before its first rollout
    buffers = []
    for uses_both in (True, False, False):
        kept = gradients.lend_zeroed(0)
        assert frozen.grad is None and torch.equal(used.grad, torch.zeros(3))
        loss = (used * 2).sum() + ((sometimes * 3).sum() if uses_both else 0)
        loss.backward()
        magrpo._drop_unused_gradients(optimizer, kept)
        before = sometimes.detach().clone()
        optimizer.step()
        buffers.append(used.grad.data_ptr())
        assert torch.equal(used.grad, torch.full((3,), 2.0))
        if not uses_both:
            assert sometimes.grad is None and torch.equal(sometimes.detach(), before)
    assert buffers[0] == buffers[1] == buffers[2]
    gradients.take_back(0)
    assert used.grad is None and sometimes.grad is None


def test_agents_of_one_shape_take_turns_with_one_set_of_gradient_buffers():
    """Agents whose parameters match share gradient buffers, lent to one agent at a time and zeroed on
    each loan, so one agent's gradients never leak into the other's step; agents of another shape
    get their own."""
    from comlrl.trainers.reinforce import magrpo

    first, second, other = (torch.nn.Linear(4, 3), torch.nn.Linear(4, 3), torch.nn.Linear(4, 5))
    optimizers = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (first, second, other)]
    gradients = magrpo._GradientBuffers(optimizers)
    x = torch.ones(2, 4)
    pointers = []
    for index, model in enumerate((first, second, other)):
        expected = torch.autograd.grad(model(x).pow(2).sum(), model.weight)[0]
        gradients.lend_zeroed(index)
        model(x).pow(2).sum().backward()
        assert torch.equal(model.weight.grad, expected)  # nothing left over from the previous agent
        pointers.append(model.weight.grad.data_ptr())
        gradients.take_back(index)
        assert model.weight.grad is None
    assert pointers[0] == pointers[1] != pointers[2]


@pytest.mark.parametrize("setting", ["default", "opted_out", "frozen_by_the_user"])
def test_objects_from_before_training_are_frozen_for_the_collector_while_it_runs(make_trainer, monkeypatch, setting):
    import gc

    seen = []

    def reward(completions1, completions2):
        seen.append(gc.get_freeze_count())
        return [float(len(a) > len(b)) for a, b in zip(completions1, completions2)]

    if setting == "opted_out":
        monkeypatch.setenv("COMLRL_FREEZE_GC", "0")
    trainer = make_trainer(reward=reward)
    if setting == "frozen_by_the_user":
        gc.freeze()
    try:
        before = gc.get_freeze_count()
        trainer.train()
        after = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert seen
    if setting == "default":
        # the trainer and its models are in the frozen generation during training, handed back after
        assert before == 0 and min(seen) > 10_000 and after == 0
    elif setting == "opted_out":
        assert before == 0 and set(seen) == {0} and after == 0
    else:  # the user's own freeze is left as it is: neither extended nor undone (frozen objects
        # that lose their last reference are still freed, so the count may only shrink)
        assert before > 10_000 and max(seen) <= before and before // 2 < after <= before


def test_an_update_puts_every_module_of_its_agent_in_training_mode(tiny_model_dir, monkeypatch):
    """Updates train in training mode; the walk over every module is skipped where nothing is off it."""
    from comlrl.trainers.reinforce import magrpo

    agent = load_causal_lm(tiny_model_dir)
    calls = []
    monkeypatch.setattr(type(agent), "train", lambda self, mode=True: calls.append(mode) or torch.nn.Module.train(self, mode))
    agent.train()
    calls.clear()
    magrpo._training_mode(agent)
    assert calls == []
    agent.model.layers[0].mlp.eval()
    magrpo._training_mode(agent)
    assert calls == [True] and all(m.training for m in agent.modules())
    agent.eval()
    magrpo._training_mode(agent)
    assert all(m.training for m in agent.modules())
