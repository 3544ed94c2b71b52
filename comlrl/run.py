"""Run directories of the Hydra experiment repo: saved config, resume checks, agent building.

A run dir (``outputs/<name>/<timestamp>_<uid>``) holds everything one run owns::

    run_config.yaml     the composed job config; `make resume` re-composes from it
    segments.jsonl      one row per process that trained in this dir (fresh start, then resumes)
    train.log           the Python log of every segment (Hydra job logging, appended)
    .hydra/             Hydra's own record of the first launch (.hydra/resume-*/ for later ones)
    metrics.jsonl       one row per logged env_step (written by the trainer)
    checkpoints/        checkpoint-<epochs>/ (and step-<updates>/) written by the trainer
    wandb/              W&B offline segments (logger=wandb)
    final/agent_<i>/    the trained agents (save_pretrained) once the run completed
    curves.png          `make plot RUN=...`

This module keeps the experiment entry points (`experiments/main.py`, `experiments/resume.py`)
free of logic: they call the functions below. Importing it registers the ``uid`` resolver that
the run dir names use (also in launcher worker processes, which import it when they unpickle the
task function).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

RUN_CONFIG = "run_config.yaml"
SEGMENTS = "segments.jsonl"
CHECKPOINT_SUBDIR = "checkpoints"

# Overrides `make resume` accepts besides the trainer's own run-shape keys: they change how long,
# where and how a run reports, never what it computes. `resume` is set by the resume entry itself.
RESUME_ALLOWED_PATTERNS = ("checkpoint.*", "logger.mode", "hydra.*")
# Hydra settings the resume entry owns: the run must continue in its own dir.
RESUME_RESERVED = ("hydra.run.dir", "hydra.output_subdir", "hydra.job.name", "resume")
# Fallback when the trainer is not importable (the trainer's RUN_SHAPE_KEYS is the source of truth).
_FALLBACK_RUN_SHAPE_KEYS = ("num_train_epochs", "logging_steps", "agent_devices")


class RunDirError(RuntimeError):
    """A run dir or a resume request that cannot be honoured; the message says what to do."""


# ------------------------------------------------------------------------------------------------
# Resolvers
# ------------------------------------------------------------------------------------------------

STAMP_FORMAT = "%Y-%m-%d_%H-%M-%S"
#: Set this (e.g. `make train NPROC=2` does) to give every process of one run the same run dir name.
RUN_STAMP_ENV = "COMLRL_RUN_STAMP"


def _uid(nchars: Any = 4) -> str:
    return secrets.token_hex(16)[: int(nchars or 4)]


def _torchrun_agent_stamp() -> Optional[str]:
    """Under torchrun, a name every local rank derives alike: the launcher's start time + its id.

    The ranks are children of one torchrun agent, so its start time (from /proc, Linux) and the
    rendezvous id are shared; Python's own clock is not (ranks can straddle a second)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    agent = os.getppid()
    try:
        fields = Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        started = boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        raise RuntimeError(
            f"Under torchrun every rank needs the same run dir: set {RUN_STAMP_ENV}=<name> for all ranks "
            "(make train NPROC=N does) or pass hydra.run.dir=<dir>."
        ) from None
    suffix = hashlib.sha256(f"{run_id}:{agent}".encode()).hexdigest()[:4]
    return f"{_dt.datetime.fromtimestamp(started).strftime(STAMP_FORMAT)}_{suffix}"


def _run_stamp() -> str:
    """`<YYYY-MM-DD_HH-MM-SS>_<4 hex>`: the run dir's name under outputs/<name>/."""
    return (os.environ.get(RUN_STAMP_ENV) or _torchrun_agent_stamp()
            or f"{_dt.datetime.now().strftime(STAMP_FORMAT)}_{_uid(4)}")


def register_resolvers() -> None:
    """``${run_stamp:}`` (run dir names) and ``${uid:}`` (a short random hex suffix).

    Two runs started in the same second would otherwise share ``outputs/<name>/<timestamp>``, so
    both end in 4 random hex digits. ``use_cache=True`` stores the value in the config's resolver
    cache, which Hydra copies into every job's config (like ``${now:...}``), so a dir resolves to
    one name everywhere. The processes of one torchrun job agree on one name (see `_run_stamp`).
    """
    if not OmegaConf.has_resolver("uid"):
        OmegaConf.register_new_resolver("uid", _uid, use_cache=True)
    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", _run_stamp, use_cache=True)


register_resolvers()


# ------------------------------------------------------------------------------------------------
# Saving the composed config
# ------------------------------------------------------------------------------------------------

# Interpolations that depend on where/how the process runs are kept as written, so a run dir that
# is moved or resumed elsewhere still points at itself.
_DIR_DEPENDENT = re.compile(r"\$\{\s*(hydra:|output_dir\b)")


def partially_resolved(cfg: DictConfig) -> Dict[str, Any]:
    """The config as plain containers, interpolations resolved to their values (`${seed}` -> 0,
    `${oc.env:X}` -> its value now) except dir-dependent ones and references to whole subtrees."""

    def walk(node: Any) -> Any:
        if isinstance(node, DictConfig):
            out = {}
            for key in node.keys():
                out[key] = leaf(node, key)
            return out
        if isinstance(node, ListConfig):
            return [leaf(node, i) for i in range(len(node))]
        return node

    def leaf(parent: Any, key: Any) -> Any:
        child = parent._get_node(key)
        if OmegaConf.is_interpolation(parent, key):
            raw = child._value()
            if isinstance(raw, str) and _DIR_DEPENDENT.search(raw):
                return raw
            try:
                value = parent[key]
            except Exception:  # e.g. a resolver that only works inside a Hydra job
                return raw
            # A reference to a whole subtree (`${model.path}`) stays a reference: the subtree is
            # saved where it is defined, and the file keeps one knob per setting.
            return raw if isinstance(value, (DictConfig, ListConfig)) else value
        if OmegaConf.is_missing(parent, key):
            return "???"
        if isinstance(child, (DictConfig, ListConfig)):
            if child._is_none():
                return None
            return walk(child)
        return child._value()

    return walk(cfg)


def save_run_config(cfg: DictConfig, run_dir: Path, note: str = "") -> Path:
    """Write `run_dir/run_config.yaml` atomically (partially resolved; see `partially_resolved`)."""
    path = Path(run_dir) / RUN_CONFIG
    body = OmegaConf.to_yaml(OmegaConf.create(partially_resolved(cfg)))
    header = (
        "# Composed config of this run, written by experiments/main.py.\n"
        "# `make resume RUN=<this dir>` re-composes from this file; only run-shape settings may change.\n"
    )
    if note:
        header += "".join(f"# {line}\n" for line in note.splitlines())
    tmp = path.with_name(f".{RUN_CONFIG}.tmp-{os.getpid()}")
    tmp.write_text(header + body)
    os.replace(tmp, path)
    return path


def load_run_config(run_dir: os.PathLike | str) -> DictConfig:
    """The saved config of a run, with a clear error when `run_dir` is not a run dir."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(
            f"Run dir {str(run_dir)!r} does not exist. Pass the dir a training run printed at its end, "
            "e.g. RUN=outputs/default/2025-01-31_12-00-00_ab12."
        )
    path = run_dir / RUN_CONFIG
    if not path.is_file():
        raise RunDirError(
            f"{run_dir} has no {RUN_CONFIG}, so it is not a run dir of experiments/main.py (or its run "
            "died before it started). Pass the run's own dir, the one holding checkpoints/."
        )
    return OmegaConf.load(path)


# ------------------------------------------------------------------------------------------------
# Resume: allowed overrides and config drift
# ------------------------------------------------------------------------------------------------

def run_shape_keys() -> List[str]:
    try:
        from comlrl.trainers.reinforce.magrpo import RUN_SHAPE_KEYS
    except Exception:  # pragma: no cover - the trainer is part of the package
        return list(_FALLBACK_RUN_SHAPE_KEYS)
    return sorted(RUN_SHAPE_KEYS)


def allowed_resume_patterns(extra_trainer_keys: Iterable[str] = ()) -> List[str]:
    """Dotted keys (``a.*`` = the subtree) that may differ between a run and its resume."""
    keys = set(run_shape_keys()) | set(extra_trainer_keys)
    if "*" in keys:
        return ["trainer.*", *RESUME_ALLOWED_PATTERNS]
    return [f"trainer.{k}" for k in sorted(keys)] + list(RESUME_ALLOWED_PATTERNS)


def _matches(key: str, patterns: Sequence[str]) -> bool:
    for pattern in patterns:
        if pattern.endswith(".*"):
            prefix = pattern[:-2]
            if key == prefix or key.startswith(prefix + "."):
                return True
        elif key == pattern:
            return True
    return False


def parse_overrides(overrides: Sequence[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:
        raise RunDirError(f"Cannot parse the overrides {list(overrides)}: {exc}") from None


def check_resume_overrides(overrides: Sequence[str], saved: Optional[DictConfig] = None) -> Dict[str, Any]:
    """Refuse every override that is not run-shape; return {key: value} of the accepted ones.

    Runs before anything is written. Trainer keys listed in `trainer.allow_resume_drift` (saved or
    overridden) are accepted too: that is the trainer's own, explicit escape hatch.
    """
    parsed = parse_overrides(overrides)
    accepted: Dict[str, Any] = {}
    for ov in parsed:
        key = ov.key_or_group.replace("/", ".")
        if ov.is_sweep_override():
            raise RunDirError(f"Resume takes single values, not a sweep: {ov.input_line!r}.")
        if key == "trainer.allow_resume_drift" and not ov.is_delete():
            accepted[key] = ov.value()
    drift = list(accepted.get("trainer.allow_resume_drift") or [])
    if saved is not None and not drift:
        drift = list(OmegaConf.select(saved, "trainer.allow_resume_drift", default=None) or [])
    patterns = allowed_resume_patterns(drift)

    for ov in parsed:
        key = ov.key_or_group.replace("/", ".")
        if key in RESUME_RESERVED:
            raise RunDirError(
                f"Resume refuses the override {ov.input_line!r}: `{key}` is set by the resume itself "
                "(the run continues in its own dir)."
            )
        if ov.package is not None or not _matches(key, patterns):
            raise RunDirError(
                f"Resume refuses the override {ov.input_line!r}: `{key}` changes what the run computes, and "
                f"a resumed run must match its checkpoints. Allowed on resume: {', '.join(patterns)}. "
                "To change anything else, start a new run (make train ARGS=\"...\")."
            )
        if not ov.is_delete():
            accepted[key] = ov.value()
    return accepted


def _flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(tree, dict):
        flat: Dict[str, Any] = {}
        if not tree and prefix:
            flat[prefix] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: tree}


def config_drift(saved: DictConfig, current: DictConfig, patterns: Sequence[str]) -> List[str]:
    """'key: saved -> current' for every key outside `patterns` (and `resume`) that differs."""
    patterns = [*patterns, "resume"]
    before = _flatten(partially_resolved(saved))
    after = _flatten(partially_resolved(current))
    lines = []
    for key in sorted(set(before) | set(after)):
        if _matches(key, patterns):
            continue
        a, b = before.get(key, "<absent>"), after.get(key, "<absent>")
        if json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str):
            lines.append(f"{key}: {a!r} -> {b!r}")
    return lines


# ------------------------------------------------------------------------------------------------
# Checkpoints of a run
# ------------------------------------------------------------------------------------------------

def checkpoint_dir(run_dir: os.PathLike | str) -> Path:
    return Path(run_dir) / CHECKPOINT_SUBDIR


def latest_checkpoint(run_dir: os.PathLike | str) -> Optional[Path]:
    """The run's latest *complete* checkpoint (decided by the progress stored inside), or None."""
    from comlrl.utils import find_latest_checkpoint

    return find_latest_checkpoint(checkpoint_dir(run_dir))


def checkpoint_progress(checkpoint: os.PathLike | str) -> Dict[str, Any]:
    """{"epoch", "buffer_in_epoch", "updates_done", "env_step", ...} stored in a checkpoint."""
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    return dict(state.get("progress", {}))


def checkpoint_world_size(checkpoint: os.PathLike | str) -> Optional[int]:
    """How many data-parallel ranks wrote `checkpoint` (None for checkpoints that do not say)."""
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    return int(state["world_size"]) if state.get("world_size") is not None else None


# ------------------------------------------------------------------------------------------------
# Preparing a run dir (called by experiments/main.py before anything is built)
# ------------------------------------------------------------------------------------------------

def _job_overrides() -> List[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:
        return []


def requeue_count() -> int:
    """How often the scheduler has requeued this job (SLURM sets SLURM_RESTART_COUNT); 0 otherwise."""
    try:
        return max(0, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
    except ValueError:
        return 0


def prepare_run_dir(cfg: DictConfig, run_dir: os.PathLike | str) -> Optional[str]:
    """Check the run dir against `cfg.resume`, save the config, record the segment.

    Returns the trainer's `resume_from_checkpoint` ("auto" or None). Every check runs before this
    function writes anything.

    * Fresh run (`resume=false`): the dir must not already be a run (no run_config.yaml).
    * Under torchrun only rank 0 checks and writes.
    * `resume=true`: the composed config may differ from the saved one only in run-shape keys; the
      saved config is then updated with them (so a later resume continues to the new target). A
      dir without a saved config starts fresh, so a requeued cluster job with `resume=true`
      works from its first start on.
    * A requeued SLURM job (`SLURM_RESTART_COUNT` > 0: preempted, or requeued by submitit after
      a time-out) resumes as if `resume=true` were set: it re-runs in its own job dir, which
      already holds its config and checkpoints.
    """
    run_dir = Path(run_dir)
    saved_path = run_dir / RUN_CONFIG
    now = _dt.datetime.now().isoformat(timespec="seconds")
    overrides = _job_overrides()
    requeues = requeue_count()
    resuming = bool(cfg.get("resume", False)) or requeues > 0
    if int(os.environ.get("RANK", "0")) != 0:
        # torchrun: rank 0 owns the run dir (checks, config, segments), as it owns checkpoints and
        # logs; if it refuses to start, torchrun stops the other ranks.
        return "auto" if resuming else None

    if not resuming and saved_path.exists():
        raise RunDirError(
            f"{run_dir} already holds a run ({RUN_CONFIG} exists). Continue it with "
            f"`make resume RUN={run_dir}`, or start a new run in a new dir (drop hydra.run.dir)."
        )
    latest = None
    if resuming and saved_path.exists():
        saved = OmegaConf.load(saved_path)
        drift_keys = cfg.trainer.get("allow_resume_drift") or saved.trainer.get("allow_resume_drift") or []
        problems = config_drift(saved, cfg, allowed_resume_patterns(drift_keys))
        if problems:
            raise RunDirError(
                f"Cannot resume {run_dir}: the config differs from its {RUN_CONFIG} outside the run-shape "
                "settings:\n  - " + "\n  - ".join(problems)
                + f"\nAllowed on resume: {', '.join(allowed_resume_patterns(drift_keys))}. Nothing was written."
            )
        latest = latest_checkpoint(run_dir)

    run_dir.mkdir(parents=True, exist_ok=True)
    note = f"written {now}; overrides: {' '.join(overrides) or '(none)'}"
    save_run_config(cfg, run_dir, note)
    segment = {
        "started": now,
        "resume": resuming,
        "resumed_from": latest.name if latest is not None else None,
        **({"requeue": requeues} if requeues else {}),
        "overrides": overrides,
        "pid": os.getpid(),
    }
    if latest is not None:
        progress = checkpoint_progress(latest)
        segment.update(epoch=progress.get("epoch"), env_step=progress.get("env_step"))
    with open(run_dir / SEGMENTS, "a") as fh:
        fh.write(json.dumps(segment) + "\n")
    return "auto" if resuming else None


def read_segments(run_dir: os.PathLike | str) -> List[Dict[str, Any]]:
    path = Path(run_dir) / SEGMENTS
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a torn last line of a killed process
    return rows


# ------------------------------------------------------------------------------------------------
# Building objects from the model group
# ------------------------------------------------------------------------------------------------

def build_agents(model_cfg: DictConfig) -> list:
    """`model.agents` (one config per agent) or `model.num_agents` copies of `model.agent`."""
    from hydra.utils import instantiate

    specs = model_cfg.get("agents")
    declared = model_cfg.get("num_agents")
    if specs:
        specs = list(specs)
        if declared is not None and declared != len(specs):
            raise ValueError(
                f"model.num_agents={declared} but model.agents lists {len(specs)} configs; make them agree."
            )
    else:
        if model_cfg.get("agent") is None:
            raise ValueError("The model config needs `agent` (copied num_agents times) or an `agents` list.")
        specs = [model_cfg.agent] * int(declared or 2)
    return [instantiate(spec) for spec in specs]  # one call per agent: independent weights


def build_tokenizer(model_cfg: DictConfig):
    """One tokenizer, or a list with one per agent."""
    from hydra.utils import instantiate

    spec = model_cfg.tokenizer
    if isinstance(spec, ListConfig):
        return [instantiate(s) for s in spec]
    return instantiate(spec)
