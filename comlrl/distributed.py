"""Data parallelism over torch.distributed: one home for every collective the trainer uses.

Launch with ``torchrun --nproc_per_node=P ...``: each rank samples and scores a contiguous shard of
every update buffer's prompts, gradients are summed across ranks after each minibatch (every rank's
loss is pre-scaled by its share of the global minibatch, so the sum is the single-process gradient
up to reduction order), and all ranks step identical AdamW states, so weights stay identical.
Metrics are reduced to rank 0, which alone logs and writes checkpoints (holding every rank's RNG
state). Without torchrun (no WORLD_SIZE) everything here is a no-op for a single process.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, List, Sequence

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    owns_process_group: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ setup
    @classmethod
    def from_environment(cls, device_type: str) -> "DistContext":
        """Join the process group torchrun describes in the environment (gloo on CPU, nccl on GPU)."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), False)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        backend = "nccl" if device_type == "cuda" and dist.is_nccl_available() else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
        return cls(dist.get_rank(), dist.get_world_size(), True)

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False

    # ------------------------------------------------------------------ sharding
    def shard(self, positions: Sequence[int]) -> List[int]:
        """This rank's contiguous block of `positions` (sizes differ by at most one).

        Contiguous blocks keep the global node order of every turn equal to the ranks' local orders
        concatenated, which is what makes the minibatches match a single process."""
        n, p = len(positions), self.world_size
        start = self.rank * (n // p) + min(self.rank, n % p)
        size = n // p + (1 if self.rank < n % p else 0)
        return list(positions[start:start + size])

    # ------------------------------------------------------------------ collectives
    def all_gather_int(self, value: int) -> List[int]:
        if not self.enabled:
            return [int(value)]
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, int(value))
        return [int(v) for v in out]

    def all_gather_object(self, obj: Any) -> List[Any]:
        if not self.enabled:
            return [obj]
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum_float(self, value: float) -> float:
        if not self.enabled:
            return float(value)
        return float(sum(self.all_gather_object(float(value))))

    def any_flag(self, flag: bool) -> bool:
        if not self.enabled:
            return bool(flag)
        return any(self.all_gather_object(bool(flag)))

    def sum_gradients(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Sum every gradient across ranks in one flat buffer (ranks without rows contribute zeros)."""
        if not self.enabled:
            return
        params = [p for p in parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()
