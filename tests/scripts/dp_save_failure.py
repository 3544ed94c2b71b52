"""Data-parallel run whose rank 0 fails to write its second checkpoint (as on a full disk).

    torchrun --nproc_per_node=2 dp_save_failure.py MODEL_DIR RUN_DIR

Every rank must stop with an error instead of waiting for rank 0 at the end of the save.
"""

import os
import sys
from pathlib import Path

import torch

from comlrl import checkpoint
from comlrl.data import story_prompts
from comlrl.models import load_causal_lm, load_tokenizer
from comlrl.rewards import length_ratio_reward
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

torch.set_num_threads(1)
model_dir, run_dir = sys.argv[1], Path(sys.argv[2])
if os.environ.get("RANK") == "0":
    real_save, saves = checkpoint.save_checkpoint, []

    def save_until_the_disk_fills(target, *args, **kwargs):
        saves.append(target)
        if len(saves) == 2:
            raise OSError(28, "No space left on device")
        return real_save(target, *args, **kwargs)

    checkpoint.save_checkpoint = save_until_the_disk_fills
trainer = MAGRPOTrainer(
    agents=[load_causal_lm(model_dir) for _ in range(2)],
    tokenizer=load_tokenizer(model_dir),
    reward_func=length_ratio_reward,
    train_dataset=story_prompts(),
    args=MAGRPOConfig(num_turns=1, num_train_epochs=3, num_generations=2, max_new_tokens=8, logging_steps=1,
                      rollout_buffer_size=4, show_progress=False),
    wandb_config=None,
)
try:
    trainer.train(checkpoint_dir=str(run_dir / "checkpoints"), checkpoint_interval=1)
finally:
    trainer.close()
