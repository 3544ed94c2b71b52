"""The user's resume example, as researchers write it, run as a script by the tests.

    python seed_example.py MODEL_DIR RUN_DIR first|resume|straight EPOCHS

Only `model_name` (a local tiny model) and the checkpoint/W&B locations differ from the example.
After training it stores each agent's weights in RUN_DIR/final_<phase>/ so tests can compare runs.
"""

import math
import os
import sys
from pathlib import Path

from datasets import Dataset
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.utils import read_checkpoint_metadata

model_name, run_dir, phase, epochs = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])

tokenizer = AutoTokenizer.from_pretrained(model_name)
train_dataset = Dataset.from_dict({
    "prompt": [
        "Describe a city in the clouds:",
        "Invent a new holiday and explain it:",
        "Write a bedtime story for a dragon:",
        "Design a playground on Mars:",
    ]
})


def length_ratio_reward(completions1, completions2):
    rewards = []
    for first, second in zip(completions1, completions2):
        ratio = len(second) / max(len(first), 1)
        distance = 0.0 if 2 <= ratio <= 3 else min(abs(ratio - 2), abs(ratio - 3))
        rewards.append(math.exp(-distance))
    return rewards


def build_trainer(num_train_epochs, wandb_config):
    config = MAGRPOConfig(
        num_turns=1,
        num_train_epochs=num_train_epochs,
        num_generations=4,
        max_new_tokens=64,
        logging_steps=1,
    )
    return MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(model_name) for _ in range(2)],
        tokenizer=tokenizer,
        reward_func=length_ratio_reward,
        train_dataset=train_dataset,
        args=config,
        wandb_config=wandb_config,
        metrics_path=str(run_dir / "metrics.jsonl"),
    )


wandb_config = {"project": "comlrl-examples", "name": "resume-demo", "dir": str(run_dir)}
checkpoint_dir = str(run_dir / "checkpoints")

if phase in ("first", "straight"):
    trainer = build_trainer(num_train_epochs=epochs, wandb_config=wandb_config)
    trainer.train(checkpoint_dir=checkpoint_dir, checkpoint_interval=1)
else:
    checkpoint = max(
        Path(checkpoint_dir).glob("checkpoint-*"),
        key=lambda path: int(path.name.rsplit("-", 1)[1]),
    )
    identity = read_checkpoint_metadata(checkpoint)["wandb"]
    if identity:
        wandb_config = {**wandb_config, **identity, "resume": "allow"}
    trainer = build_trainer(num_train_epochs=epochs, wandb_config=wandb_config)
    trainer.train(
        resume_from_checkpoint=str(checkpoint),
        checkpoint_dir=checkpoint_dir,
        checkpoint_interval=1,
    )

final = run_dir / f"final_{phase}"
final.mkdir(exist_ok=True)
for i, agent in enumerate(trainer.agents):
    save_model(agent, str(final / f"agent_{i}.safetensors"))
print("done", os.getpid())
