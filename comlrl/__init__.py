"""comlrl: cooperative multi-LLM reinforcement learning (MAGRPO) with exact stop/resume."""

__version__ = "0.1.0"
