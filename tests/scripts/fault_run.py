"""A small run that always resumes from its latest complete checkpoint, for fault injection.

    COMLRL_KILL_AT=<site>:<n> python fault_run.py MODEL_DIR RUN_DIR

Step checkpoints after every update, W&B offline into RUN_DIR, metrics.jsonl, final weights in
RUN_DIR/final/.
"""

import sys
from pathlib import Path

from safetensors.torch import save_model

from comlrl.data import story_prompts
from comlrl.models import load_causal_lm, load_tokenizer
from comlrl.rewards import length_ratio_reward
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

model_dir, run_dir = sys.argv[1], Path(sys.argv[2])
trainer = MAGRPOTrainer(
    agents=[load_causal_lm(model_dir) for _ in range(2)],
    tokenizer=load_tokenizer(model_dir),
    reward_func=length_ratio_reward,
    train_dataset=story_prompts(),
    args=MAGRPOConfig(num_turns=1, num_train_epochs=2, num_generations=2, max_new_tokens=8, logging_steps=1,
                      agent_learning_rate=1e-3, show_progress=False),
    wandb_config={"project": "faults", "dir": str(run_dir), "mode": "offline"},
    metrics_path=str(run_dir / "metrics.jsonl"),
)
trainer.train(checkpoint_dir=str(run_dir / "checkpoints"), checkpoint_steps=1, resume_from_checkpoint="auto")
(run_dir / "final").mkdir(exist_ok=True)
for i, agent in enumerate(trainer.agents):
    save_model(agent, str(run_dir / "final" / f"agent_{i}.safetensors"))
