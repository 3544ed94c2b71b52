"""Checkpoints: atomic save, validation, loading, RNG capture, fingerprints and drift checks.

Layout of one checkpoint directory::

    checkpoint-<epochs>/          epoch checkpoint (the name the seed example's glob relies on)
    step-<updates>/               step checkpoint (never matches ``checkpoint-*``)
        agent_<i>/model.safetensors   weights
        agent_<i>/optimizer.pt        AdamW state (loaded with weights_only=True)
        rng_state.pt                  python / numpy / torch CPU / CUDA generator states
        trainer_state.json            progress, config, fingerprints
        metadata.json                 version, trainer_class, sequence, run_id, wandb
        manifest.json                 every file's size; written last

A checkpoint is written to a hidden temporary directory, fsynced, then renamed into place, so a
directory with a final name is complete. Latest is chosen by the progress stored inside, and a
directory whose files do not match its manifest is skipped with a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from comlrl import faults

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
EPOCH_PATTERN = re.compile(r"^checkpoint-(\d+)$")
STEP_PATTERN = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with the reason and the fix in its message."""


# --------------------------------------------------------------------------------------------------
# Fingerprints
# --------------------------------------------------------------------------------------------------


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def model_fingerprint(model) -> str:
    config = model.config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "_attn_implementation_autoset",
                     "_commit_hash", "architectures"):
        config.pop(volatile, None)
    return _sha(json.dumps(config, sort_keys=True, default=str).encode())


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = json.loads(backend.to_str())
        body.pop("truncation", None)
        body.pop("padding", None)  # padding side is switched at sampling time; not part of identity
        payload = json.dumps(body, sort_keys=True)
    else:
        payload = json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)
    return _sha((payload + specials).encode())


def dataset_fingerprint(dataset) -> Optional[str]:
    if dataset is None:
        return None
    digest = hashlib.sha256()
    digest.update(str(len(dataset)).encode())
    for row in dataset:
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def callable_fingerprint(fn: Optional[Callable]) -> Optional[str]:
    """Qualified name + hash of the source (and of partial arguments), so a renamed or edited
    reward/transition is noticed on resume."""
    if fn is None:
        return None
    bound = ""
    while isinstance(fn, functools.partial):
        bound += repr(fn.args) + repr(sorted(fn.keywords.items()))
        fn = fn.func
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        source = ""
    return f"{name}:{_sha((source + bound).encode())}"


# --------------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------------


def capture_rng_state() -> Dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["numpy"]
    np.random.set_state(
        (npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))


def save_checkpoint(
    target: Path,
    agents: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    trainer_state: Dict[str, Any],
    metadata: Dict[str, Any],
    rng_states: Optional[List[Dict[str, Any]]] = None,
) -> Path:
    """Write a checkpoint atomically to `target` (temporary dir → fsync → rename)."""
    target = Path(target)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f"{TMP_PREFIX}{target.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for i, (agent, optimizer) in enumerate(zip(agents, optimizers)):
        agent_dir = tmp / f"agent_{i}"
        agent_dir.mkdir()
        # save_model handles tied weights (embeddings shared with the LM head).
        save_model(_unwrap(agent), str(agent_dir / "model.safetensors"))
        torch.save(optimizer.state_dict(), agent_dir / "optimizer.pt")
    faults.point("checkpoint_files")
    ranks = rng_states if rng_states is not None else [capture_rng_state()]
    torch.save({"world_size": len(ranks), "ranks": ranks}, tmp / "rng_state.pt")
    _write_json(tmp / "trainer_state.json", trainer_state)
    _write_json(tmp / "metadata.json", metadata)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(tmp)): p.stat().st_size for p in files}
    _write_json(tmp / "manifest.json", {"format": CHECKPOINT_FORMAT, "files": manifest})
    for p in files + [tmp / "manifest.json"]:
        _fsync_file(p)
    for d in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
        _fsync_dir(d)
    if target.exists():
        # Only reached when a run resumed from an older checkpoint redoes this one; the content is the
        # same training state, swapped in atomically.
        trash = parent / f"{TMP_PREFIX}old-{target.name}-{os.getpid()}"
        os.rename(target, trash)
        os.rename(tmp, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, target)
    _fsync_dir(parent)
    faults.point("checkpoint_renamed")
    return target


def _unwrap(model):
    return getattr(model, "module", model)


# --------------------------------------------------------------------------------------------------
# Reading and validation
# --------------------------------------------------------------------------------------------------


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why `path` is not a complete checkpoint, or None when it is."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} does not exist or is not a directory"
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        return f"{manifest_path} is missing (the checkpoint was not completely written)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as exc:
        return f"{manifest_path} is unreadable ({exc})"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} is truncated or altered ({f.stat().st_size} bytes, manifest says {size})"
    return None


def read_trainer_state(path: Path) -> Dict[str, Any]:
    return json.loads((Path(path) / "trainer_state.json").read_text())


def read_checkpoint_metadata(checkpoint) -> Dict[str, Any]:
    """Metadata of a checkpoint: ``{"version", "trainer_class", "sequence", "run_id", "wandb"}``.

    ``wandb`` is ``{"id", "project", "entity"?}`` when the run logged to W&B, else None, so it can be
    merged into ``wandb_config`` to continue the same W&B run.
    """
    path = Path(checkpoint)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"Cannot read checkpoint metadata: {problem}.")
    meta = json.loads((path / "metadata.json").read_text())
    return {k: meta.get(k) for k in ("version", "trainer_class", "sequence", "run_id", "wandb")}


def list_checkpoints(checkpoint_dir) -> List[Path]:
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and (EPOCH_PATTERN.match(p.name) or STEP_PATTERN.match(p.name)))


def _progress_key(path: Path) -> Tuple[int, int]:
    state = read_trainer_state(path)
    # Prefer the epoch checkpoint when a step checkpoint holds the same progress.
    return int(state["progress"]["updates_done"]), 1 if EPOCH_PATTERN.match(path.name) else 0


def find_latest_checkpoint(checkpoint_dir) -> Optional[Path]:
    """The complete checkpoint with the most training progress in `checkpoint_dir`, or None.

    Incomplete or damaged directories are skipped with a warning, so a crash in the middle of a
    write falls back to the previous complete checkpoint.
    """
    best, best_key = None, None
    for path in list_checkpoints(checkpoint_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            try:
                key = _progress_key(path)
            except (ValueError, KeyError) as exc:
                problem = f"{path / 'trainer_state.json'} is unreadable ({exc})"
        if problem is not None:
            warnings.warn(f"Skipping damaged checkpoint {path}: {problem}.", stacklevel=2)
            continue
        if best_key is None or key > best_key:
            best, best_key = path, key
    return best


def rank_seed(seed: int, rank: int) -> int:
    """Sampling seed of a data-parallel rank (rank 0 keeps `seed`, so one process is unchanged)."""
    return seed + 1_000_003 * rank


def load_checkpoint(path: Path, agents, optimizers, rank: int = 0, world_size: int = 1, seed: int = 0) -> Dict[str, Any]:
    """Restore weights, optimizer states and RNG states; return the trainer state dict."""
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(
            f"Checkpoint {path} cannot be used: {problem}. Resume from an earlier complete checkpoint "
            "(find_latest_checkpoint skips damaged ones)."
        )
    state = read_trainer_state(path)
    if len(agents) != state["num_agents"]:
        raise CheckpointError(f"Checkpoint {path} holds {state['num_agents']} agents, but the trainer has {len(agents)}.")
    for i, (agent, optimizer) in enumerate(zip(agents, optimizers)):
        agent_dir = path / f"agent_{i}"
        try:
            missing, unexpected = load_model(_unwrap(agent), str(agent_dir / "model.safetensors"), strict=False)
        except Exception as exc:
            raise CheckpointError(f"Cannot load {agent_dir / 'model.safetensors'}: {exc}") from exc
        if missing or unexpected:
            raise CheckpointError(
                f"{agent_dir / 'model.safetensors'} does not match agent {i}: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}."
            )
        try:
            optimizer.load_state_dict(torch.load(agent_dir / "optimizer.pt", weights_only=True, map_location="cpu"))
        except Exception as exc:
            raise CheckpointError(f"Cannot load {agent_dir / 'optimizer.pt'}: {exc}") from exc
        # map_location=cpu keeps loading device-agnostic; move optimizer state next to its parameters.
        for group in optimizer.param_groups:
            for param in group["params"]:
                for key, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        optimizer.state[param][key] = value.to(param.device)
    try:
        rng = torch.load(path / "rng_state.pt", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"Cannot load {path / 'rng_state.pt'}: {exc}") from exc
    saved = rng["ranks"]
    if rank < len(saved):
        restore_rng_state(saved[rank])
    else:
        # More ranks than when the checkpoint was written: the python stream (identical on all ranks)
        # comes from rank 0, a new sampling stream is derived from the seed and the progress.
        restore_rng_state(saved[0])
        torch.manual_seed(rank_seed(seed, rank) + int(state["progress"]["updates_done"]))
    if len(saved) != world_size:
        log.warning("Checkpoint %s was written by %d ranks and is resumed by %d: training continues with the same "
                    "samples (they are keyed per prompt), but gradients are summed in another order, so the run is "
                    "equal to an uninterrupted one only up to float rounding, not bit for bit (re-sharded).",
                    path, len(saved), world_size)
    return state


# --------------------------------------------------------------------------------------------------
# Drift
# --------------------------------------------------------------------------------------------------


def config_drift(saved: Dict[str, Any], current: Dict[str, Any], allowed: Iterable[str]) -> List[str]:
    """Human-readable lines for every key whose value differs and may not change on resume."""
    allowed = set(allowed)
    lines = []
    for key in sorted(set(saved) | set(current)):
        if key in allowed:
            continue
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str):
            lines.append(f"{key}: checkpoint {a!r} -> now {b!r}")
    return lines


def prune_checkpoints(checkpoint_dir: Path, keep_epoch: Optional[int]) -> None:
    """Keep the newest `keep_epoch` epoch checkpoints, and only the newest step checkpoint that is
    ahead of every epoch checkpoint (older step checkpoints are superseded)."""
    paths = [p for p in list_checkpoints(checkpoint_dir) if checkpoint_problem(p) is None]
    epoch = sorted((p for p in paths if EPOCH_PATTERN.match(p.name)), key=_progress_key)
    step = sorted((p for p in paths if STEP_PATTERN.match(p.name)), key=_progress_key)
    doomed = []
    if keep_epoch is not None and len(epoch) > keep_epoch:
        doomed += epoch[: len(epoch) - keep_epoch]
    newest_epoch = _progress_key(epoch[-1])[0] if epoch else -1
    for i, p in enumerate(step):
        if i < len(step) - 1 or _progress_key(p)[0] <= newest_epoch:
            doomed.append(p)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)


def dataclass_to_dict(obj) -> Dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(obj), default=str))
