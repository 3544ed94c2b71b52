"""Side-by-side MAGRPO benchmark: our `comlrl` vs CoMLRL 1.4.3 from PyPI.

Run with the project venv (it imports our tiny-model builder)::

    .venv/bin/python benchmarks/run.py                    # all workloads, 3 alternating repeats
    .venv/bin/python benchmarks/run.py --update-readme    # ... and rewrite the README table
    .venv/bin/python benchmarks/run.py --smoke            # quick check that the harness runs

Both libraries import as `comlrl`, so CoMLRL lives in its own venv, `benchmarks/.venv-ref`
(created here if missing). Each measurement is a fresh subprocess of `benchmarks/workload.py`
under one interpreter or the other; runs alternate ours / CoMLRL / ours / CoMLRL ... so slow drift
on a shared machine hits both sides alike. See benchmarks/README.md for what is timed.
"""

from __future__ import annotations

import sys
from pathlib import Path

# benchmarks/profile.py would shadow the standard library's `profile` module (which `cProfile`,
# and through it torch/transformers, import) while this folder is sys.path[0]. Drop the folder.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import tempfile
from dataclasses import asdict, dataclass

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
WORKLOAD = BENCH_DIR / "workload.py"
REF_VENV = BENCH_DIR / ".venv-ref"
REF_PY = REF_VENV / "bin" / "python"
CACHE = BENCH_DIR / ".cache"
RESULTS = BENCH_DIR / "results"
README = BENCH_DIR / "README.md"
CONSTRAINTS = REPO / "constraints.txt"

REF_VERSION = "1.4.3"
# Always pinned in the same pip command: a CPU wheel of this torch is on disk, while an unpinned
# torch would pull a multi-GB CUDA build.
REF_TORCH = "torch==2.13.0"

TABLE_START = "<!-- bench:table:start -->"
TABLE_END = "<!-- bench:table:end -->"

# What is measured: our library in fp32 (the same arithmetic as CoMLRL), our library with bf16
# matrix products (`MAGRPOConfig(mixed_precision="bf16")`: weights, gradients and AdamW state stay
# fp32; CoMLRL has no such setting), and CoMLRL 1.4.3.
LIBS = {"ours": "ours", "ours-bf16": "ours, bf16", "reference": f"CoMLRL {REF_VERSION}"}
MIXED_PRECISION = {"ours": "no", "ours-bf16": "bf16"}


def _library(side: str) -> str:
    """The library a side runs: "ours" or "reference"."""
    return "reference" if side == "reference" else "ours"


def ours_python() -> str:
    venv_py = REPO / ".venv" / "bin" / "python"
    return str(venv_py) if venv_py.exists() else sys.executable


@dataclass(frozen=True)
class Workload:
    name: str
    size: str
    prompts: int
    num_generations: int
    epochs: int
    max_new_tokens: int = 64

    def describe(self) -> str:
        return (
            f"{self.size} model, {self.prompts} prompts, K={self.num_generations}, "
            f"{self.max_new_tokens} tokens, {self.epochs} epoch{'s' if self.epochs > 1 else ''}"
        )


WORKLOADS = {
    w.name: w
    for w in (
        Workload("S-small", "small", prompts=4, num_generations=4, epochs=4),
        Workload("S-medium", "medium", prompts=4, num_generations=4, epochs=4),
        Workload("L", "medium", prompts=32, num_generations=8, epochs=1),
    )
}
SMOKE = Workload("smoke", "small", prompts=4, num_generations=4, epochs=1)


# ------------------------------------------------------------------------------------------------
# Environment preparation
# ------------------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ref_venv_ok() -> bool:
    if not REF_PY.exists():
        return False
    probe = subprocess.run(
        [str(REF_PY), "-c", "import importlib.metadata as m; print(m.version('comlrl'))"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=tempfile.gettempdir(),
    )
    return probe.returncode == 0 and probe.stdout.strip() == REF_VERSION


def ensure_ref_venv() -> None:
    """Create benchmarks/.venv-ref with CoMLRL 1.4.3 unless it is already there (idempotent)."""
    if ref_venv_ok():
        return
    _log(f"[bench] creating {REF_VENV} with comlrl=={REF_VERSION} ...")
    if not REF_PY.exists():
        subprocess.run(["python3", "-m", "venv", str(REF_VENV)], check=True)
    cmd = [str(REF_PY), "-m", "pip", "install", "--quiet"]
    if CONSTRAINTS.exists():
        cmd += ["-c", str(CONSTRAINTS)]
    cmd += [REF_TORCH, f"comlrl=={REF_VERSION}"]
    subprocess.run(cmd, check=True, env=_clean_env(), cwd=tempfile.gettempdir())
    if not ref_venv_ok():
        raise SystemExit(f"{REF_VENV} does not provide comlrl {REF_VERSION} after install")


def model_dir(size: str) -> Path:
    """benchmarks/.cache/tiny-qwen2-<size>-<spec hash>, built with our builder if missing."""
    from comlrl.models.tiny import spec_hash  # run.py runs under our venv

    out = CACHE / f"tiny-qwen2-{size}-{spec_hash(size)}"
    if not (out / "comlrl_tiny_model.json").exists():
        _log(f"[bench] building tiny {size} model in {out}")
        subprocess.run(
            [ours_python(), "-m", "comlrl.models.tiny", str(out), "--size", size],
            check=True,
            env=_env_for("ours"),
            cwd=str(REPO),
            stdout=subprocess.DEVNULL,
        )
    return out


def _clean_env() -> dict:
    env = dict(os.environ)
    for key in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONSAFEPATH"):
        env.pop(key, None)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        WANDB_SILENT="true",
        PYTHONHASHSEED="0",
    )
    return env


def _env_for(lib: str) -> dict:
    env = _clean_env()
    if _library(lib) == "ours":
        env["PYTHONPATH"] = str(REPO)
    return env


def _interpreter(lib: str) -> str:
    return ours_python() if _library(lib) == "ours" else str(REF_PY)


# ------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------


def run_once(lib: str, wl: Workload, mdir: Path, seed: int, log_dir: Path, idx: int) -> dict:
    """One fresh workload process; returns its result JSON (verified to be the right library)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="comlrl-bench-") as tmp:
        out_json = Path(tmp) / "result.json"
        cmd = [
            _interpreter(lib),
            str(WORKLOAD),
            "--model-dir", str(mdir),
            "--prompts", str(wl.prompts),
            "--num-generations", str(wl.num_generations),
            "--epochs", str(wl.epochs),
            "--max-new-tokens", str(wl.max_new_tokens),
            "--seed", str(seed),
            "--expect-library", _library(lib),
            "--json-out", str(out_json),
        ]
        if lib in MIXED_PRECISION:
            cmd += ["--mixed-precision", MIXED_PRECISION[lib]]
        # Ours runs from the repo root with PYTHONPATH=repo; the reference runs from a temp dir
        # with no PYTHONPATH so nothing of this checkout can shadow the PyPI `comlrl`.
        cwd = str(REPO) if _library(lib) == "ours" else tmp
        log_path = log_dir / f"{wl.name}-{lib}-{idx}.log"
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.run(
                cmd, cwd=cwd, env=_env_for(lib), stdout=log, stderr=subprocess.STDOUT
            )
        if proc.returncode != 0 or not out_json.exists():
            tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
            raise SystemExit(
                f"[bench] {wl.name} / {lib} failed (exit {proc.returncode}); log {log_path}:\n{tail}"
            )
        result = json.loads(out_json.read_text())
    comlrl_file = Path(result["comlrl_file"])
    expected_root = REPO / "comlrl" if _library(lib) == "ours" else REF_VENV
    if expected_root.resolve() not in comlrl_file.resolve().parents:
        raise SystemExit(f"[bench] {lib} imported comlrl from {comlrl_file}, not {expected_root}")
    return result


def summarise(runs: list[dict]) -> dict:
    times = [r["train_s"] for r in runs]
    cpu = [r.get("train_cpu_s") for r in runs]
    cpu = [c for c in cpu if c is not None]
    rss = [r["peak_rss_mb"] for r in runs]
    return {
        "n": len(runs),
        "median_train_s": statistics.median(times),
        "min_train_s": min(times),
        "max_train_s": max(times),
        "median_train_s_per_epoch": statistics.median(r["train_s_per_epoch"] for r in runs),
        "median_train_cpu_s": statistics.median(cpu) if cpu else None,
        "train_cpu_s": cpu,
        "peak_rss_mb": max(rss),
        "median_peak_rss_mb": statistics.median(rss),
        # file-backed huge pages counted in RSS (see workload._file_huge_pages_mb): not the
        # workload's memory; a large value makes that library's peak RSS read high
        "max_file_huge_pages_mb": max(r.get("file_huge_pages_mb", 0.0) for r in runs),
        "comlrl_version": runs[0]["comlrl_version"],
        "comlrl_file": runs[0]["comlrl_file"],
        "torch": runs[0]["torch"],
        "transformers": runs[0]["transformers"],
        "train_s": times,
    }


#: The host's speed right now: fp32 products of one shape (an L loss chunk's rows by a 1024-wide
#: weight) on one thread, in a process of its own. The benchmark hosts are shared, and their product
#: speed moved by ~20% within minutes (70.7-86.4 GFLOP/s over 40 samples in 2 minutes); our side is
#: bound by products and follows it more closely than CoMLRL, whose time is mostly per-call
#: overhead. Measured before each round of alternating runs, so that a reader can tell a run's
#: spell from its code.
HOST_PROBE = """
import time, torch
torch.set_num_threads(1)
a, b = torch.randn(534, 1024), torch.randn(1024, 256)
for _ in range(5):
    a.mm(b)
start, products = time.perf_counter(), 0
while time.perf_counter() - start < {seconds}:
    a.mm(b)
    products += 1
print(2 * 534 * 1024 * 256 * products / (time.perf_counter() - start) / 1e9)
"""


def host_probe(seconds: float = 0.5) -> float | None:
    """`HOST_PROBE`'s GFLOP/s under the project venv's torch (None if it could not run)."""
    result = subprocess.run([ours_python(), "-c", HOST_PROBE.format(seconds=seconds)], capture_output=True,
                            text=True, env=_env_for("ours"))
    try:
        return round(float(result.stdout.split()[-1]), 1)
    except (ValueError, IndexError):
        return None


def run_workload(wl: Workload, libs: list[str], repeats: int, seed: int, log_dir: Path) -> dict:
    mdir = model_dir(wl.size)
    runs: dict[str, list[dict]] = {lib: [] for lib in libs}
    probes = []
    for rep in range(repeats):
        probes.append(host_probe())
        _log(f"[bench] {wl.name:9s} round {rep + 1}/{repeats}: host probe {probes[-1]} GFLOP/s "
             "(fp32 products, one thread)")
        for lib in libs:  # A B A B ...
            res = run_once(lib, wl, mdir, seed, log_dir, rep)
            runs[lib].append(res)
            _log(
                f"[bench] {wl.name:9s} {LIBS[lib]:13s} run {rep + 1}/{repeats}: "
                f"{res['train_s']:.2f} s (CPU {res.get('train_cpu_s', float('nan')):.2f} s), "
                f"peak RSS {res['peak_rss_mb']:.0f} MB"
                + (f" (of which file-backed huge pages {res['file_huge_pages_mb']:.0f} MB: not the workload's memory)"
                   if res.get("file_huge_pages_mb", 0.0) >= 8 else "")
            )
    entry = {"workload": asdict(wl), "description": wl.describe(), "host_probe_gflops": probes}
    for lib in libs:
        entry[lib] = summarise(runs[lib])
    for side in ("ours", "ours-bf16"):
        if side in entry and "reference" in entry:
            entry[f"ratio_reference_over_{side}"] = (
                entry["reference"]["median_train_s"] / entry[side]["median_train_s"]
            )
            if entry[side]["median_train_cpu_s"] and entry["reference"]["median_train_cpu_s"]:
                entry[f"cpu_ratio_reference_over_{side}"] = (
                    entry["reference"]["median_train_cpu_s"] / entry[side]["median_train_cpu_s"]
                )
    return entry


# ------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------


def native_bf16() -> bool:
    """Whether our venv's torch has native bf16 products on this CPU (`comlrl.precision`)."""
    probe = "from comlrl.precision import cpu_has_native_bf16; print(cpu_has_native_bf16())"
    result = subprocess.run([ours_python(), "-c", probe], capture_output=True, text=True, env=_env_for("ours"))
    return result.returncode != 0 or result.stdout.strip() == "True"  # a failed probe runs bf16 and shows why


def _cpuinfo(key: str) -> str | None:
    """The first `key: value` of /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or "unknown"


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info(results: dict) -> dict:
    versions = {}
    for entry in results.values():
        for lib in ("ours", "reference"):
            if lib in entry:
                versions.setdefault(lib, {"torch": entry[lib]["torch"],
                                          "transformers": entry[lib]["transformers"]})
    return {
        "cpu": cpu_model(),
        "cpu_vector": cpu_vector_units(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def _fmt_s(summary: dict | None) -> str:
    if summary is None:
        return "–"
    return f"{summary['median_train_s']:.2f}"


def _fmt_cpu(summary: dict | None) -> str:
    if summary is None or summary.get("median_train_cpu_s") is None:
        return "–"
    return f"{summary['median_train_cpu_s']:.2f}"


def _fmt_ratio(ratio) -> str:
    return "–" if ratio is None else f"{ratio:.2f}×"


def cpu_vector_units() -> str:
    """The vector units that decide which kernels run: "AVX-512, AVX512-BF16", "AVX2 only", ...
    (two hosts that both call themselves "AMD EPYC" ran these benchmarks 2x apart)."""
    listed = _cpuinfo("flags")
    if listed is None:
        return "unknown"
    flags = set(listed.split())
    named = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"))
             if flag in flags]
    if named:
        return ", ".join(named)
    return "AVX2 only" if "avx2" in flags else "no AVX2"


def _fmt_rss(summary: dict | None) -> str:
    return "–" if summary is None else f"{summary['peak_rss_mb']:.0f}"


def markdown_table(results: dict) -> str:
    """One row per workload and measured side of ours (fp32; bf16 products), each against CoMLRL."""
    ref = LIBS["reference"]
    lines = [
        f"| workload | setting | ours | ours (s) | {ref} (s) | {ref} / ours | "
        f"ours CPU (s) | {ref} CPU (s) | CPU ratio | "
        f"ours peak RSS (MB) | {ref} peak RSS (MB) | runs |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, entry in results.items():
        refs = entry.get("reference")
        sides = [side for side in ("ours", "ours-bf16") if side in entry] or [None]
        for side in sides:
            ours = entry.get(side) if side else None
            runs = "/".join(str(s["n"]) for s in (ours, refs) if s is not None)
            precision = {"ours": "fp32", "ours-bf16": "bf16 products", None: "–"}[side]
            lines.append(
                f"| {name} | {entry['description']} | {precision} | {_fmt_s(ours)} | {_fmt_s(refs)} | "
                f"{_fmt_ratio(entry.get(f'ratio_reference_over_{side}'))} | "
                f"{_fmt_cpu(ours)} | {_fmt_cpu(refs)} | "
                f"{_fmt_ratio(entry.get(f'cpu_ratio_reference_over_{side}'))} | "
                f"{_fmt_rss(ours)} | {_fmt_rss(refs)} | {runs} |"
            )
    return "\n".join(lines)


def machine_line(info: dict, date: str) -> str:
    v = info["versions"]
    vers = "; ".join(
        f"{LIBS[lib]}: torch {d['torch']}, transformers {d['transformers']}" for lib, d in v.items()
    )
    load = ""
    if info.get("loadavg_start"):
        load = f" Load average (1 min) {info['loadavg_start'][0]} at start"
        if info.get("loadavg_end"):
            load += f", {info['loadavg_end'][0]} at end"
        load += "."
    probes = info.get("host_probe_gflops")
    if probes:
        spread = f"{min(probes):.1f}" if min(probes) == max(probes) else f"{min(probes):.1f}-{max(probes):.1f}"
        load += f" Host speed probe before each round (fp32 products, one thread): {spread} GFLOP/s."
    skipped = info.get("bf16_skipped")
    skipped = f" {skipped[0].upper()}{skipped[1:]}." if skipped else ""
    return (
        f"Measured {date} on {info['cpu']} ({info.get('cpu_vector', 'vector units not recorded')}; "
        f"{info['cores']} cores), 1 torch thread, "
        f"Python {info['python']}; {vers}.{load}{skipped}"
    )


def update_readme(table: str, info: dict, date: str, repeats: int, readme: Path = README) -> None:
    text = readme.read_text(encoding="utf-8")
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit(f"{readme} lacks the {TABLE_START} / {TABLE_END} markers")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    body = (
        f"{TABLE_START}\n{machine_line(info, date)} Median of {repeats} alternating runs each: "
        f"wall seconds of `trainer.train()`, and its process CPU seconds (steadier when the "
        f"machine is shared); peak RSS is the max over runs.\n\n{table}\n{TABLE_END}"
    )
    readme.write_text(head + body + tail, encoding="utf-8")


# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="ours vs CoMLRL 1.4.3, side by side")
    p.add_argument("--repeats", type=int, default=3, help="runs per library per workload")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma list of {list(WORKLOADS)}"
    )
    p.add_argument(
        "--only", choices=list(LIBS), default=None, help="measure one side only"
    )
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 side of ours")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny workload (small model, 1 epoch), 1 run, ours only unless --with-reference",
    )
    p.add_argument("--with-reference", action="store_true", help="with --smoke: also CoMLRL")
    p.add_argument("--update-readme", action="store_true", help="rewrite the README table")
    p.add_argument(
        "--readme",
        action="append",
        default=None,
        help=f"file(s) whose {TABLE_START} ... {TABLE_END} section --update-readme rewrites "
        "(repeatable; default benchmarks/README.md)",
    )
    p.add_argument("--json-out", default=None, help="results file (default: results/<date>.json for a full run of "
                   "every workload and side, .cache/results/<time>.json for a partial one)")
    p.add_argument("--no-save", action="store_true", help="do not write a results file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")

    if args.smoke:
        workloads = [SMOKE]
        repeats = 1
        libs = ["ours", "reference"] if args.with_reference else ["ours"]
    else:
        names = [n.strip() for n in args.workloads.split(",") if n.strip()]
        unknown = [n for n in names if n not in WORKLOADS]
        if unknown:
            raise SystemExit(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
        workloads = [WORKLOADS[n] for n in names]
        repeats = args.repeats
        libs = ["ours", "reference"] if args.no_bf16 else ["ours", "ours-bf16", "reference"]
    bf16_skipped = None
    if "ours-bf16" in libs and not native_bf16():
        # Without AVX-512 or AMX, bf16 products run on reference kernels, several times slower than
        # fp32 (S-medium 64 s against 8.5 s on an AVX2-only EPYC): the trainer warns against it,
        # and timing it would add a quarter of an hour to say so.
        libs.remove("ours-bf16")
        bf16_skipped = "ours in bf16 not run: this CPU has no native bf16 (AVX-512 or AMX), where it is several times slower than fp32"
        _log(f"[bench] {bf16_skipped}")
    if args.only:
        libs = [args.only]
    # Only a run of every workload on every side stands for the day: it alone writes
    # results/<date>.json and the README table.
    complete = (not args.smoke and set(wl.name for wl in workloads) == set(WORKLOADS)
                and set(libs) == ({"ours", "reference"} if bf16_skipped else {"ours", "ours-bf16", "reference"}))
    if args.update_readme and not complete:
        raise SystemExit("--update-readme needs a full run: every workload, ours, ours-bf16 (where the CPU has native bf16) and CoMLRL")

    if "reference" in libs:
        ensure_ref_venv()

    date = _dt.date.today().isoformat()
    load_start = loadavg()
    if load_start and load_start[0] > 0.5 * (os.cpu_count() or 1):
        _log(
            f"[bench] warning: load average {load_start[0]} on {os.cpu_count()} cores; "
            "other processes will slow both sides (alternation keeps the ratio fairer)"
        )
    log_dir = CACHE / "logs" / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    results = {}
    for wl in workloads:
        results[wl.name] = run_workload(wl, libs, repeats, args.seed, log_dir)

    info = machine_info(results)
    info["loadavg_start"] = load_start
    info["loadavg_end"] = loadavg()
    info["host_probe_gflops"] = [p for entry in results.values() for p in entry["host_probe_gflops"] if p is not None]
    if bf16_skipped:
        info["bf16_skipped"] = bf16_skipped
    table = markdown_table(results)
    print(machine_line(info, date))
    print()
    print(table)

    payload = {
        "date": date,
        "timestamp": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": info,
        "repeats": repeats,
        "seed": args.seed,
        "libraries": libs,
        "smoke": bool(args.smoke),
        "results": results,
    }
    save_to = None
    if args.json_out:
        save_to = Path(args.json_out)
    elif not args.no_save and complete:
        save_to = RESULTS / f"{date}.json"
    elif not args.no_save and not args.smoke:
        # A partial run must not replace the day's full results (the table in the README cites them).
        save_to = CACHE / "results" / f"{payload['timestamp'].replace(':', '')}.json"
    if save_to is not None:
        save_to.parent.mkdir(parents=True, exist_ok=True)
        save_to.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        _log(f"[bench] wrote {save_to}")
    if args.update_readme:
        for readme in args.readme or [README]:
            update_readme(table, info, date, repeats, Path(readme))
            _log(f"[bench] updated {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
