"""Data-parallel run under torchrun (gloo on CPU); resumes from its latest checkpoint if any.

    torchrun --nproc_per_node=2 dp_run.py MODEL_DIR RUN_DIR [EPOCHS]

Every rank stores its final weights in RUN_DIR/final_rank<r>/ so tests can compare ranks.
"""

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_model

from comlrl.data import story_prompts
from comlrl.models import load_causal_lm, load_tokenizer
from comlrl.rewards import length_ratio_reward
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

torch.set_num_threads(1)
model_dir, run_dir = sys.argv[1], Path(sys.argv[2])
epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 2
trainer = MAGRPOTrainer(
    agents=[load_causal_lm(model_dir) for _ in range(2)],
    tokenizer=load_tokenizer(model_dir),
    reward_func=length_ratio_reward,
    train_dataset=story_prompts(),
    args=MAGRPOConfig(num_turns=1, num_train_epochs=epochs, num_generations=2, max_new_tokens=8, logging_steps=1,
                      agent_learning_rate=1e-3, rollout_buffer_size=4, train_batch_size=2, show_progress=False),
    wandb_config={"project": "dp", "dir": str(run_dir), "mode": "offline"},
    metrics_path=str(run_dir / "metrics.jsonl"),
)
try:
    trainer.train(checkpoint_dir=str(run_dir / "checkpoints"), checkpoint_steps=1, resume_from_checkpoint="auto")
    out = run_dir / f"final_rank{os.environ.get('RANK', '0')}"
    out.mkdir(exist_ok=True)
    for i, agent in enumerate(trainer.agents):
        save_model(agent, str(out / f"agent_{i}.safetensors"))
finally:
    trainer.close()
