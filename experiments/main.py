"""Hydra entry point: compose conf/, build every object via `_target_`, train, save.

    python experiments/main.py                                  # the tiny default run
    python experiments/main.py model=qwen2.5-0.5b logger.mode=online trainer.num_train_epochs=4
    python experiments/main.py -m trainer.num_generations=2,4 hydra/launcher=joblib
    python experiments/main.py experiment=three_agents          # a preset of conf/experiment/
    make resume RUN=outputs/default/<timestamp>                  # see experiments/resume.py
    make train NPROC=2                                           # data-parallel ranks via torchrun

No training logic lives here: the loop is `comlrl.trainers.reinforce.MAGRPOTrainer`, run-dir
bookkeeping is `comlrl.run`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from comlrl.run import build_agents, build_tokenizer, checkpoint_dir, prepare_run_dir, register_resolvers
from comlrl.trainers.reinforce import MAGRPOTrainer, TrainingPreempted

log = logging.getLogger("comlrl.experiments.main")
register_resolvers()  # ${uid:} in the run dir name must exist before @hydra.main composes


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(cfg.output_dir)
    resume_from = prepare_run_dir(cfg, run_dir)  # checks, run_config.yaml, segments.jsonl
    log.info("Run dir: %s (%s)", run_dir, "resuming" if resume_from else "fresh run")

    tokenizer = build_tokenizer(cfg.model)
    agents = build_agents(cfg.model)
    reward_func = instantiate(cfg.reward.func)
    train_dataset = instantiate(cfg.data.train)
    eval_dataset = instantiate(cfg.data.eval) if cfg.data.get("eval") else None
    # Multi-turn runs: conf/transition/<option> (`transition=reward_feedback` or a preset); none by default.
    external_transition = instantiate(cfg.transition) if cfg.get("transition") else None
    args = instantiate(cfg.trainer)
    wandb_config = OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else None

    trainer = MAGRPOTrainer(
        agents=agents,
        tokenizer=tokenizer,
        reward_func=reward_func,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        external_transition=external_transition,
        args=args,
        wandb_config=wandb_config,
        metrics_path=str(run_dir / "metrics.jsonl"),
    )
    try:
        summary = trainer.train(
            resume_from_checkpoint=resume_from,
            checkpoint_dir=str(checkpoint_dir(run_dir)),
            checkpoint_interval=cfg.checkpoint.interval,
            checkpoint_total_limit=cfg.checkpoint.total_limit,
            checkpoint_steps=cfg.checkpoint.steps,
        )
        trainer.save_model(str(run_dir / "final"))
    except TrainingPreempted as stop:  # SIGTERM/SIGUSR1/SIGINT: checkpointed, exits with status 75
        log.warning("%s. Continue with: make resume RUN=%s", stop, run_dir)
        raise
    finally:
        trainer.close()
    log.info("Done: %s", summary)
    if os.environ.get("RANK", "0") == "0":  # torchrun: one line, not one per rank
        print(f"Run dir: {run_dir}")


if __name__ == "__main__":
    main()
