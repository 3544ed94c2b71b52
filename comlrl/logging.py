"""Metrics sink: Weights & Biases and ``metrics.jsonl``, with step de-duplication.

Every row is logged at ``env_step``. A resumed run redoes the work after its checkpoint; those steps
were possibly logged already by the process that died. Each destination keeps its own high-water
mark, so a step reaches each exactly once: ``metrics.jsonl``'s is read from the file itself, the W&B
one from the offline segments of the same run id (a row can reach the file and die before W&B, or
the other way round). Online, W&B drops such steps itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

from comlrl import faults

log = logging.getLogger(__name__)

WANDB_KEYS = ("project", "entity", "name", "dir", "tags", "id", "resume", "mode", "group", "notes", "job_type")


def default_wandb_mode(wandb_config: Dict[str, Any]) -> str:
    """Explicit mode, else $WANDB_MODE, else online only when credentials exist.

    Without an account the run is written offline instead of failing, so examples run anywhere;
    `make sync` (or `wandb sync`) uploads it later.
    """
    if wandb_config.get("mode"):
        return str(wandb_config["mode"])
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY") or Path("~/.netrc").expanduser().is_file():
        return "online"
    return "offline"


class MetricsSink:
    def __init__(self, wandb_config: Optional[Dict[str, Any]], metrics_path: Optional[str], enabled: bool = True,
                 completions_path: Optional[str] = None):
        self.wandb_config = dict(wandb_config) if wandb_config is not None else None
        if self.wandb_config is not None:
            unknown = sorted(set(self.wandb_config) - set(WANDB_KEYS) - {"config_sections"})
            if unknown:
                raise ValueError(f"wandb_config has unknown keys {unknown}; allowed: {list(WANDB_KEYS)}.")
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.completions_path = Path(completions_path) if completions_path else None
        self.enabled = enabled  # False on non-zero ranks
        self.jsonl_high = -1
        self.completions_high = -1
        self.wandb_high = -1
        self.run = None
        self._identity: Optional[Dict[str, str]] = None

    # ---------------------------------------------------------------- lifecycle
    def start(self, run_config: Dict[str, Any], resume_identity: Optional[Dict[str, str]], last_logged_step: int) -> None:
        """Open the destinations. `last_logged_step` is the checkpoint's: rows up to it are final."""
        self.jsonl_high = self.wandb_high = int(last_logged_step)
        if not self.enabled:
            return
        if self.metrics_path is not None:
            self.jsonl_high = max(self.jsonl_high, _repair_jsonl(self.metrics_path))
        self.completions_high = self.jsonl_high
        if self.completions_path is not None:
            self.completions_high = max(int(last_logged_step), _repair_jsonl(self.completions_path))
        if self.wandb_config is None:
            return
        import wandb

        cfg = dict(self.wandb_config)
        if resume_identity and not cfg.get("id"):
            cfg.update({k: v for k, v in resume_identity.items() if v})
            cfg.setdefault("resume", "allow")
        run_id = cfg.get("id") or uuid.uuid4().hex[:12]  # os.urandom: leaves the training RNG untouched
        mode = default_wandb_mode(cfg)
        wandb_dir = Path(cfg.get("dir") or os.environ.get("WANDB_DIR") or ".")
        wandb_dir.mkdir(parents=True, exist_ok=True)
        init_kwargs = {k: cfg[k] for k in ("project", "entity", "name", "dir", "tags", "group", "notes", "job_type") if cfg.get(k)}
        # Read what earlier offline segments of this run really hold before opening a new one: a
        # process killed with SIGKILL loses the rows its W&B service had not written yet.
        offline_high = _offline_high_water(wandb_dir, run_id) if mode == "offline" else None
        self.run = wandb.init(id=run_id, resume=cfg.get("resume"), mode=mode, config=run_config, **init_kwargs)
        self._identity = {"id": self.run.id, "project": self.run.project or cfg.get("project")}
        entity = getattr(self.run, "entity", None) or cfg.get("entity")
        if entity:
            self._identity["entity"] = entity
        if offline_high is not None and offline_high < self.wandb_high:
            self._backfill_wandb(after=offline_high, upto=self.wandb_high)

    def _backfill_wandb(self, after: int, upto: int) -> None:
        """Re-send rows that reached metrics.jsonl but not W&B (after <= step <= upto), in order."""
        self.wandb_high = after
        if self.metrics_path is None or not self.metrics_path.exists():
            log.warning("W&B offline segments stop at step %d but the checkpoint logged up to %d, and there is no "
                        "metrics.jsonl to restore them from; those W&B points are missing.", after, upto)
            self.wandb_high = upto
            return
        for line in self.metrics_path.read_text().splitlines():
            row = json.loads(line)
            step = int(row.pop("env_step"))
            if after < step <= upto:
                self.run.log(row, step=step)
                self.wandb_high = step
        self.wandb_high = upto

    def identity(self) -> Optional[Dict[str, str]]:
        return dict(self._identity) if self._identity else None

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

    # ---------------------------------------------------------------- logging
    def log(self, step: int, metrics: Dict[str, Any], samples: Optional[List[Dict[str, Any]]] = None) -> bool:
        """Log one row at `step` to every destination that has not had it yet.

        `samples` (prompt, each agent's completion, reward) go to completions.jsonl and to a W&B table
        in the same row, so they can be read next to the curves.
        """
        wrote = False
        if self.enabled and self.metrics_path is not None and step > self.jsonl_high:
            self.jsonl_high = step
            wrote = True
            _append_line(self.metrics_path, {"env_step": step, **{k: _jsonable(v) for k, v in metrics.items()}})
        if self.enabled and samples and self.completions_path is not None and step > self.completions_high:
            self.completions_high = step
            for sample in samples:
                _append_line(self.completions_path, {"env_step": step, **sample})
        faults.point("log_written")
        if self.run is not None and step > self.wandb_high:
            self.wandb_high = step
            wrote = True
            row = dict(metrics)
            if samples:
                row["completions"] = _wandb_table(samples)
            self.run.log(row, step=step)
        return wrote


def _append_line(path: Path, row: Dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _wandb_table(samples: List[Dict[str, Any]]):
    import wandb

    num_agents = len(samples[0]["completions"])
    table = wandb.Table(columns=["turn", "prompt"] + [f"agent_{i}" for i in range(num_agents)] + ["reward"])
    for s in samples:
        table.add_data(s["turn"], s["prompt"], *s["completions"], s["reward"])
    return table


def _repair_jsonl(path: Path) -> int:
    """Drop a torn last line left by a killed process; return the highest env_step in the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        return -1
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data[: data.rfind(b"\n") + 1]
        log.warning("Dropping a torn last line of %s (a previous process died mid-write).", path)
        with open(path, "wb") as fh:
            fh.write(keep)
        data = keep
    high = -1
    for line in data.decode().splitlines():
        if line.strip():
            high = max(high, int(json.loads(line)["env_step"]))
    return high


def _offline_high_water(wandb_dir: Path, run_id: str) -> int:
    try:
        from comlrl.wandb_offline import find_offline_runs
    except ImportError:  # pragma: no cover - reader is part of the package
        return -1
    high = -1
    try:
        runs = find_offline_runs(wandb_dir)
    except Exception as exc:  # a damaged segment must not stop training; jsonl/ckpt still guard steps
        log.warning("Could not scan W&B offline segments in %s: %s", wandb_dir, exc)
        return -1
    for run in runs:
        if run.run_id == run_id:
            for row in run.history:
                high = max(high, int(row.get("_step", -1)))
    return high


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
