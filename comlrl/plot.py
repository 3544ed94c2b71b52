"""Training curves of a run dir: `python -m comlrl.plot RUN [--out FILE]` (`make plot RUN=...`).

Reads `RUN/metrics.jsonl` (one row per logged env_step) and draws, against env_step, the mean
reward (and expected return) per turn, each agent's loss and each agent's completion length into
`RUN/curves.png`. Dashed vertical lines mark where the run was resumed, taken from
`RUN/segments.jsonl` (written by experiments/main.py at every start); rows that carry a
"segment" field of their own (a trainer-side marker) are used the same way.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    rows = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed process
        if isinstance(row, dict) and "env_step" in row:
            rows.append(row)
    return rows


def resume_points(run_dir: Path, rows: Sequence[Dict[str, Any]]) -> List[float]:
    """env_steps at which a resumed segment started."""
    from comlrl.run import read_segments

    points = [float(s["env_step"]) for s in read_segments(run_dir)
              if s.get("resume") and s.get("env_step") is not None]
    previous = None
    for row in rows:  # trainer-side markers, if the rows carry them
        segment = row.get("segment")
        if segment is not None and previous is not None and segment != previous:
            points.append(float(row["env_step"]))
        previous = segment if segment is not None else previous
    return sorted(set(points))


def _series(rows: Sequence[Dict[str, Any]], key: str):
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(row["env_step"])
            ys.append(value)
    return xs, ys


def _keys(rows: Sequence[Dict[str, Any]], pattern: str) -> List[str]:
    regex = re.compile(pattern)
    found = {k for row in rows for k in row if regex.fullmatch(k)}
    return sorted(found, key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)])


def plot_run(run_dir: str | Path, out: Optional[str | Path] = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl; pass a run dir of experiments/main.py.")
    rows = sorted(read_metrics(metrics_path), key=lambda r: r["env_step"])
    if not rows:
        raise ValueError(f"{metrics_path} holds no rows yet.")

    panels = [
        ("reward", _keys(rows, r"(eval/)?turn_\d+/(reward_mean|expected_return)")),
        ("loss", _keys(rows, r"agent_\d+/loss")),
        ("completion length (tokens)", _keys(rows, r"agent_\d+/completion_length")),
    ]
    panels = [(title, keys) for title, keys in panels if keys]
    resumes = resume_points(run_dir, rows)

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.8 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, keys) in zip(axes[:, 0], panels):
        for key in keys:
            xs, ys = _series(rows, key)
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, linewidth=1.2, label=key)
        for i, step in enumerate(resumes):
            ax.axvline(step, color="grey", linestyle="--", linewidth=1, label="resumed" if i == 0 else None)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("env_step")
    fig.suptitle(str(run_dir), fontsize=8)
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Plot reward and loss curves of a run dir.")
    parser.add_argument("run", help="run dir holding metrics.jsonl")
    parser.add_argument("--out", help="output image (default RUN/curves.png)")
    args = parser.parse_args(argv)
    try:
        out = plot_run(args.run, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"plot: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
