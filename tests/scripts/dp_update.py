"""One global buffer, updated by P ranks or by one process: the weights must agree.

    torchrun --nproc_per_node=P dp_update.py MODEL_DIR OUT_DIR

Every rank samples the SAME full buffer (same seed, same batch), keeps only its contiguous shard of
prompts, and runs the trainer's update on it, three times. Rank 0 stores the final weights.
"""

import os
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_model

from comlrl.data import story_prompts
from comlrl.models import load_causal_lm, load_tokenizer
from comlrl.rewards import length_ratio_reward
from comlrl.rollout import AgentSamples, TurnBatch, compute_returns, sample_completions, score_turn
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

torch.set_num_threads(1)
model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
loss_type = sys.argv[3] if len(sys.argv) > 3 else "sum"
trainer = MAGRPOTrainer(
    agents=[load_causal_lm(model_dir) for _ in range(2)], tokenizer=load_tokenizer(model_dir),
    reward_func=length_ratio_reward, train_dataset=story_prompts(),
    args=MAGRPOConfig(num_turns=1, num_generations=4, max_new_tokens=12, agent_learning_rate=1e-3,
                      rollout_buffer_size=4, train_batch_size=4, loss_type=loss_type, show_progress=False),
)
k = trainer.args.num_generations
prompts = story_prompts()["prompt"]
mine = trainer.dist.shard(list(range(len(prompts))))


def slice_samples(s: AgentSamples, nodes):
    rows = [n * k + j for n in nodes for j in range(k)]
    return AgentSamples([s.prompts[n] for n in nodes], s.prompt_ids[nodes], s.prompt_mask[nodes],
                        s.completion_ids[rows], s.completion_mask[rows], [s.texts[r] for r in rows])


for update in range(3):
    torch.manual_seed(1234 + update)  # the same full buffer on every rank
    full = [sample_completions(agent, trainer.tokenizer, prompts, trainer.sampling) for agent in trainer.agents]
    turn = TurnBatch(0, [{"prompt": p} for p in prompts], [prompts] * 2, full, trainer.joint_index, None,
                     [None] * len(prompts))
    score_turn(turn, trainer.reward, 2)
    shard = TurnBatch(0, [turn.items[n] for n in mine], [[prompts[n] for n in mine]] * 2,
                      [slice_samples(s, mine) for s in full], trainer.joint_index, turn.rewards[mine], [None] * len(mine))
    compute_returns([shard], 1.0)
    random.seed(update)  # the minibatch shuffle, identical on every rank
    for i in range(2):
        trainer._update_agent(i, [shard])

if trainer.dist.is_main:
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, agent in enumerate(trainer.agents):
        save_model(agent, str(out_dir / f"agent_{i}.safetensors"))
trainer.close()
