"""Shared pytest setup: offline, single-threaded environment and cached tiny models.

The environment is set at import time (before any test module imports torch/transformers/wandb)
so that every library reads the offline and threading settings when it first loads.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
# Tests run `make` themselves; variables of an outer `make test ARGS=...` must not leak into them.
for _name in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS"):
    os.environ.pop(_name, None)
# One model cache per checkout; exported so subprocesses (end-to-end runs) reuse the same builds
# instead of building their own into ~/.cache.
os.environ.setdefault("COMLRL_CACHE", str(REPO_ROOT / ".cache" / "models"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config):
    """The CPU suite runs with any GPU hidden (from its subprocesses too): its guarantees, such as
    bit-exact resume, are the CPU's, and on a GPU machine the trainer would otherwise pick cuda:0.
    `pytest -m gpu` (`make test` runs it where a GPU is present) keeps the GPUs visible for
    tests/test_gpu.py. Nothing has initialised CUDA yet at this point: torch reads the variable then."""
    selects_gpu_tests = "gpu" in (config.option.markexpr or "").replace("not gpu", "")
    if not selects_gpu_tests:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _cache_root() -> Path:
    return Path(os.environ["COMLRL_CACHE"])


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """Path of the small tiny model (2 layers, hidden 64), built once and reused across sessions."""
    from comlrl.models import tiny_model_path

    return tiny_model_path("small", root=_cache_root())


@pytest.fixture(scope="session")
def tiny_medium_model_dir() -> str:
    """Path of the medium tiny model (4 layers, hidden 256), built once and reused across sessions."""
    from comlrl.models import tiny_model_path

    return tiny_model_path("medium", root=_cache_root())
