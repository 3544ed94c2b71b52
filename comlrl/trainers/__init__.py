"""Trainers. MAGRPO lives in `comlrl.trainers.reinforce`."""
