"""Every config of conf/ composes with Hydra's compose API, and every object it names builds.

The hub model (model=qwen2.5-0.5b, model=hf) is only composed, never instantiated: tests are offline.
Also covers the run-dir helpers the entry points rely on (comlrl.run) and the repo wiring
(Makefile targets, .ci/run, plots).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

import comlrl.run as runlib  # registers the ${uid:} resolver

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(autouse=True)
def _clean_hydra():
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def compose_cfg(overrides=(), *, config_dir=CONF, config_name="config", hydra_cfg=False):
    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir)):
        return compose(config_name, overrides=list(overrides), return_hydra_config=hydra_cfg)


@pytest.fixture(scope="module")
def tiny_dirs(tiny_model_dir, tiny_medium_model_dir):
    return tiny_model_dir, tiny_medium_model_dir


# ------------------------------------------------------------------------------------------------
# The groups and their options
# ------------------------------------------------------------------------------------------------

def test_groups_and_options_exist():
    assert {"model", "reward", "data", "trainer", "logger", "experiment"} <= {
        p.name for p in CONF.iterdir() if p.is_dir()
    }
    assert {"tiny", "tiny_hetero", "hf", "qwen2.5-0.5b"} <= set(options("model"))
    assert "length_ratio" in options("reward")
    assert {"story_prompts", "jsonl_file"} <= set(options("data"))
    assert options("trainer") == ["magrpo"]
    assert set(options("logger")) == {"wandb", "none"}


def test_default_config_is_the_tiny_offline_run():
    cfg = compose_cfg()
    assert cfg.name == "default" and cfg.seed == 0 and cfg.resume is False
    assert cfg.trainer.seed == 0 and cfg.trainer.num_turns == 1 and cfg.trainer.num_generations == 4
    assert cfg.trainer.logging_steps == 1
    assert cfg.model.agent._target_ == "comlrl.models.load_causal_lm"
    assert cfg.model.path._target_ == "comlrl.models.tiny_model_path"
    assert cfg.logger.mode == "offline" and cfg.logger.project == "comlrl"
    assert OmegaConf.to_container(cfg)["output_dir"] == "${hydra:runtime.output_dir}"
    assert cfg.checkpoint.interval == 1


def test_seed_and_name_flow_into_trainer_and_logger():
    cfg = compose_cfg(["seed=7", "name=exp1", "output_dir=/tmp/x"])
    assert cfg.trainer.seed == 7
    assert cfg.logger.name == "exp1" and cfg.logger.dir == "/tmp/x"


@pytest.mark.parametrize("option", ["tiny", "tiny_hetero"])
def test_model_options_instantiate(option, tiny_dirs):
    from comlrl.run import build_agents, build_tokenizer

    cfg = compose_cfg([f"model={option}"])
    tokenizer = build_tokenizer(cfg.model)
    agents = build_agents(cfg.model)
    assert len(agents) == cfg.model.num_agents == cfg.trainer.num_agents == 2
    assert agents[0] is not agents[1]
    assert agents[0].get_parameter("lm_head.weight").data_ptr() != agents[1].get_parameter("lm_head.weight").data_ptr()
    assert tokenizer.decode(tokenizer("hello")["input_ids"]) == "hello"
    if option == "tiny_hetero":
        assert agents[0].config.hidden_size != agents[1].config.hidden_size


def test_tiny_model_size_is_a_knob(tiny_dirs):
    from comlrl.models import tiny_model_path

    cfg = compose_cfg(["model.size=medium"])
    assert instantiate(cfg.model.agent).config.hidden_size == 256
    assert instantiate(cfg.model.path) == tiny_model_path("medium")


@pytest.mark.parametrize("option", ["qwen2.5-0.5b", "hf"])
def test_hub_models_only_compose(option):
    overrides = [f"model={option}"] + (["model.name=gpt2"] if option == "hf" else [])
    cfg = compose_cfg(overrides)
    assert cfg.model.agent._target_ == "comlrl.models.load_causal_lm"
    expected = "Qwen/Qwen2.5-0.5B" if option == "qwen2.5-0.5b" else "gpt2"
    assert cfg.model.agent.name_or_path == expected == cfg.model.tokenizer.name_or_path
    assert cfg.model.num_agents == 2


def test_hf_model_requires_a_name():
    cfg = compose_cfg(["model=hf"])
    assert OmegaConf.is_missing(cfg.model, "name")


@pytest.mark.parametrize("option", options("reward"))
def test_reward_options_instantiate(option):
    cfg = compose_cfg([f"reward={option}"])
    reward = instantiate(cfg.reward.func)
    rewards = reward(["ab", "abc"], ["abcde", "a"])
    assert len(rewards) == 2 and all(math.isfinite(r) for r in rewards)


def test_length_ratio_bounds_come_from_yaml():
    cfg = compose_cfg(["reward.func.low=1.0", "reward.func.high=1.0"])
    reward = instantiate(cfg.reward.func)
    assert reward(["ab"], ["ab"]) == [1.0]
    assert reward(["ab"], ["abcde"])[0] < 1.0


def test_data_story_prompts():
    cfg = compose_cfg(["data=story_prompts"])
    dataset = instantiate(cfg.data.train)
    assert len(dataset) == 4 and "prompt" in dataset.column_names
    assert cfg.data.eval is None


def test_data_jsonl_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": f"prompt {i}"}) + "\n" for i in range(3)))
    cfg = compose_cfg(["data=jsonl_file", f"data.train.path={path}", "data.train.prompt_field=text"])
    dataset = instantiate(cfg.data.train)
    assert dataset["prompt"] == ["prompt 0", "prompt 1", "prompt 2"]


def test_data_jsonl_file_needs_a_path():
    cfg = compose_cfg(["data=jsonl_file"])
    assert OmegaConf.is_missing(cfg.data.train, "path")


def test_trainer_config_instantiates_and_lists_every_field():
    from comlrl.trainers.reinforce import MAGRPOConfig

    cfg = compose_cfg()
    args = instantiate(cfg.trainer)
    assert isinstance(args, MAGRPOConfig)
    assert args.num_turns == 1 and args.logging_steps == 1 and args.num_agents == 2
    assert isinstance(args.allow_resume_drift, list)
    listed = {k for k in cfg.trainer if not k.startswith("_")}
    fields = {f.name for f in dataclasses.fields(MAGRPOConfig)}
    assert listed == fields, f"conf/trainer/magrpo.yaml misses {fields - listed}, has unknown {listed - fields}"


def test_trainer_devices_become_plain_lists():
    cfg = compose_cfg(["trainer.agent_devices=[cpu,cpu]"])
    args = instantiate(cfg.trainer)
    assert args.agent_devices == ["cpu", "cpu"] and type(args.agent_devices) is list


def test_logger_options():
    from comlrl.logging import WANDB_KEYS

    wandb_cfg = compose_cfg(["logger=wandb", "output_dir=/tmp/run"]).logger
    as_dict = OmegaConf.to_container(wandb_cfg, resolve=True)
    assert set(as_dict) <= set(WANDB_KEYS)
    assert as_dict["mode"] == "offline" and as_dict["dir"] == "/tmp/run" and as_dict["name"] == "default"
    assert compose_cfg(["logger=none"]).logger is None


@pytest.mark.parametrize("option", options("experiment"))
def test_experiment_options_compose(option):
    cfg = compose_cfg([f"experiment={option}"])
    assert cfg.name == option
    assert cfg.trainer._target_ == "comlrl.trainers.reinforce.MAGRPOConfig"
    if option != "qwen_story":  # the hub model is never instantiated in tests
        instantiate(cfg.trainer)


def test_experiment_smoke_is_small_and_offline():
    cfg = compose_cfg(["experiment=smoke"])
    assert cfg.trainer.num_train_epochs == 1 and cfg.trainer.max_new_tokens <= 16
    assert cfg.logger is None
    assert compose_cfg(["experiment=qwen_story"]).model.agent.name_or_path == "Qwen/Qwen2.5-0.5B"


LAUNCHERS = {
    "basic": "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
    "joblib": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
    "local": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
    "submitit_local": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
    "submitit_slurm": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
    "slurm": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_launchers_compose(launcher):
    cfg = compose_cfg([f"hydra/launcher={launcher}"], hydra_cfg=True)
    assert cfg.hydra.launcher._target_ == LAUNCHERS[launcher]
    if launcher == "local":
        assert cfg.hydra.launcher.n_jobs == 2
    if launcher == "slurm":
        assert "partition" in cfg.hydra.launcher and cfg.hydra.launcher.timeout_min > 0
        assert cfg.hydra.launcher.gpus_per_node == 1 and cfg.hydra.launcher.signal_delay_s > 0
    module, _, name = LAUNCHERS[launcher].rpartition(".")
    assert hasattr(importlib.import_module(module), name)  # the plugin is installed


def test_run_stamp_env_gives_every_process_one_dir(monkeypatch):
    monkeypatch.setenv(runlib.RUN_STAMP_ENV, "2025-01-31_12-00-00_abcd")
    assert compose_cfg(["name=abc"], hydra_cfg=True).hydra.run.dir == "outputs/abc/2025-01-31_12-00-00_abcd"


def test_run_and_sweep_dirs_are_collision_safe(monkeypatch):
    monkeypatch.delenv(runlib.RUN_STAMP_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    cfg = compose_cfg(["name=abc"], hydra_cfg=True)
    run_dirs = {str(compose_cfg(["name=abc"], hydra_cfg=True).hydra.run.dir) for _ in range(5)}
    assert len(run_dirs) == 5, "two runs composed in the same second must get different dirs"
    for run_dir in run_dirs:
        assert re.fullmatch(r"outputs/abc/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{4}", run_dir), run_dir
    # One config resolves to one name, however often it is read.
    assert cfg.hydra.run.dir == cfg.hydra.run.dir
    assert re.fullmatch(r"outputs/multirun/\S+_[0-9a-f]{4}", str(cfg.hydra.sweep.dir))
    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${hydra.job.num}"
    assert cfg.hydra.job.chdir is False


# ------------------------------------------------------------------------------------------------
# comlrl.run: saved config, re-composition, resume override checks
# ------------------------------------------------------------------------------------------------

def test_saved_run_config_recomposes_to_the_same_config(tmp_path):
    cfg = compose_cfg(["trainer.num_generations=2", "seed=3", "model=tiny_hetero"])
    runlib.save_run_config(cfg, tmp_path, note="overrides: test")
    text = (tmp_path / runlib.RUN_CONFIG).read_text()
    assert text.startswith("# Composed config")
    assert "output_dir: ${hydra:runtime.output_dir}" in text  # dir-dependent: kept
    saved = OmegaConf.load(tmp_path / runlib.RUN_CONFIG)
    assert saved.trainer.seed == 3 and not OmegaConf.is_interpolation(saved.trainer, "seed")  # resolved
    assert OmegaConf.is_interpolation(saved.logger, "dir")

    GlobalHydra.instance().clear()
    again = compose_cfg(["resume=true", "trainer.num_train_epochs=9"], config_dir=tmp_path, config_name="run_config")
    assert again.trainer.num_generations == 2 and again.trainer.seed == 3 and again.resume is True
    assert again.model.agents[1].name_or_path.size == "medium"
    patterns = runlib.allowed_resume_patterns()
    assert runlib.config_drift(saved, again, patterns) == []
    changed = compose_cfg(["trainer.temperature=0.9"], config_dir=tmp_path, config_name="run_config")
    assert runlib.config_drift(saved, changed, patterns) == ["trainer.temperature: 0.6 -> 0.9"]


def test_resume_overrides_allowed():
    accepted = runlib.check_resume_overrides([
        "trainer.num_train_epochs=4", "trainer.logging_steps=2", "trainer.agent_devices=[cpu,cpu]",
        "checkpoint.interval=2", "checkpoint.total_limit=null", "logger.mode=online", "hydra.verbose=true",
    ])
    assert accepted["trainer.num_train_epochs"] == 4 and accepted["logger.mode"] == "online"


@pytest.mark.parametrize("override, key", [
    ("trainer.temperature=0.9", "trainer.temperature"),
    ("seed=1", "seed"),
    ("model=tiny_hetero", "model"),
    ("+trainer.foo=1", "trainer.foo"),
    ("logger.project=other", "logger.project"),
    ("name=other", "name"),
])
def test_resume_overrides_refused(override, key):
    with pytest.raises(runlib.RunDirError) as info:
        runlib.check_resume_overrides(["trainer.num_train_epochs=4", override])
    message = str(info.value)
    assert f"`{key}`" in message and "trainer.num_train_epochs" in message and "checkpoint.*" in message


@pytest.mark.parametrize("override", ["hydra.run.dir=/elsewhere", "resume=false"])
def test_resume_reserved_overrides_refused(override):
    with pytest.raises(runlib.RunDirError, match="set by the resume itself"):
        runlib.check_resume_overrides([override])


def test_resume_drift_escape_hatch_allows_listed_keys():
    runlib.check_resume_overrides(["trainer.allow_resume_drift=[temperature]", "trainer.temperature=0.9"])


def test_load_run_config_errors(tmp_path):
    with pytest.raises(runlib.RunDirError, match="does not exist"):
        runlib.load_run_config(tmp_path / "missing")
    with pytest.raises(runlib.RunDirError, match="no run_config.yaml"):
        runlib.load_run_config(tmp_path)


def test_prepare_run_dir_refuses_a_fresh_run_over_an_existing_one(tmp_path):
    cfg = compose_cfg([f"output_dir={tmp_path}"])
    assert runlib.prepare_run_dir(cfg, tmp_path) is None
    before = (tmp_path / runlib.RUN_CONFIG).read_bytes()
    with pytest.raises(runlib.RunDirError, match="make resume"):
        runlib.prepare_run_dir(cfg, tmp_path)
    assert (tmp_path / runlib.RUN_CONFIG).read_bytes() == before
    resumed = compose_cfg([f"output_dir={tmp_path}", "resume=true", "trainer.num_train_epochs=5"])
    assert runlib.prepare_run_dir(resumed, tmp_path) == "auto"
    assert OmegaConf.load(tmp_path / runlib.RUN_CONFIG).trainer.num_train_epochs == 5
    drifted = compose_cfg([f"output_dir={tmp_path}", "resume=true", "trainer.top_k=3"])
    with pytest.raises(runlib.RunDirError, match="trainer.top_k"):
        runlib.prepare_run_dir(drifted, tmp_path)
    assert [s["resume"] for s in runlib.read_segments(tmp_path)] == [False, True]


# ------------------------------------------------------------------------------------------------
# Plots and repo wiring
# ------------------------------------------------------------------------------------------------

def test_plot_marks_resume_points(tmp_path):
    from comlrl.plot import plot_run, resume_points, read_metrics

    rows = [{"env_step": 8 * i, "turn_1/reward_mean": 0.1 * i, "agent_0/loss": 1.0 / i, "agent_1/loss": 0.5}
            for i in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"env_st')
    (tmp_path / runlib.SEGMENTS).write_text(
        json.dumps({"resume": False}) + "\n" + json.dumps({"resume": True, "env_step": 16}) + "\n")
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 5  # torn tail ignored
    assert resume_points(tmp_path, rows) == [16.0]
    out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png" and out.stat().st_size > 10_000


def test_make_help_lists_targets():
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for target in ("install", "train", "resume", "sweep", "plot", "sync", "bench", "test", "clean"):
        assert re.search(rf"make {target}\b", out), target
    dry = subprocess.run(["make", "-n", "-o", "install", "resume", "RUN=outputs/x", "EPOCHS=3", "ARGS=logger.mode=online"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert 'experiments/resume.py --nproc 1 "outputs/x" trainer.num_train_epochs=3 logger.mode=online' in dry


def test_ci_runs_make_test():
    ci = REPO / ".ci" / "run"
    assert os.access(ci, os.X_OK)
    text = ci.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text and "make test" in text
