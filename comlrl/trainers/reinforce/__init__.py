"""Policy-gradient trainers: MAGRPO."""

from comlrl.trainers.reinforce.magrpo import (
    PREEMPTED_EXIT_CODE,
    RUN_SHAPE_KEYS,
    MAGRPOConfig,
    MAGRPOTrainer,
    TrainingPreempted,
)

__all__ = ["MAGRPOConfig", "MAGRPOTrainer", "TrainingPreempted", "RUN_SHAPE_KEYS", "PREEMPTED_EXIT_CODE"]
