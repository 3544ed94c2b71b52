"""Where does a MAGRPO training run spend its time? Per-phase wall clock, optionally pyinstrument.

Runs the same workload as `benchmarks/workload.py` in-process and times `trainer.train()` split
into phases::

    generation     sampling (HF `generate`, incl. its forwards, tokenising, decoding)
    reward         the reward function
    forward        model forwards outside generation (the log-prob pass of the loss)
    loss           log-prob gather / log-softmax / advantage / policy-gradient loss math
    backward       `torch.autograd.backward` (what `loss.backward()` calls)
    optimizer      `Optimizer.step` (global step hooks)
    log/ckpt       metrics logging, W&B, checkpoint writes
    evaluation     `trainer.evaluate` (nothing here: the workload has no eval set)
    other          the rest of `train()`: Python bookkeeping, progress bar, data loading

Phases are exclusive (a nested phase's time is not counted again in its parent). Neither library
has `torch.profiler.record_function` scopes, so the phases come from wrapping functions at run
time: generic ones (HF `generate`, model `forward`, `torch.autograd.backward`, optimizer hooks,
the reward function, `wandb.log`) that hold for both libraries, plus each library's own loss /
logging / checkpoint functions where they exist. It works under either venv::

    .venv/bin/python benchmarks/profile.py --workload S-medium          # ours
    benchmarks/.venv-ref/bin/python benchmarks/profile.py --workload S-medium   # CoMLRL 1.4.3
    .venv/bin/python benchmarks/profile.py --workload L --pyinstrument  # + top functions

`--pyinstrument` adds a sampling profile of the same run (pyinstrument, if installed: install it
into the venv with `pip install -c constraints.txt pyinstrument`); without it, `--cprofile`
prints the top functions by cumulative time using the standard library.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named `profile.py`: with its folder at sys.path[0] it would shadow the standard
# library's `profile` module, which `cProfile` imports. Drop the folder before importing anything.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


workload = _load("comlrl_bench_workload", _HERE / "workload.py")  # sets OMP_NUM_THREADS etc.
bench_run = _load("comlrl_bench_run", _HERE / "run.py")

PHASES = [
    "generation",
    "reward",
    "forward",
    "loss",
    "backward",
    "optimizer",
    "log/ckpt",
    "evaluation",
]

# Library-specific targets: "module:attribute.path" -> phase. Missing ones are skipped, so one
# table serves ours and CoMLRL 1.4.3 (and survives refactors: the generic ones still hold).
SPECIFIC_TARGETS = {
    # ours
    "comlrl.rollout:sample_completions": "generation",
    "comlrl.rollout:sample_agents": "generation",
    "comlrl.losses:shared_prompt_token_logprobs": "forward",
    "comlrl.losses:policy_gradient_loss": "loss",
    "comlrl.losses:group_advantages": "loss",
    "comlrl.logging:MetricsSink.log": "log/ckpt",
    "comlrl.logging:MetricsSink.start": "log/ckpt",
    "comlrl.logging:MetricsSink.close": "log/ckpt",
    "comlrl.trainers.reinforce.magrpo:MAGRPOTrainer._save": "log/ckpt",
    "comlrl.trainers.reinforce.magrpo:MAGRPOTrainer._log_update": "log/ckpt",
    # CoMLRL 1.4.3
    "comlrl.trainers.reinforce.magrpo:MAGRPOTrainer._generate_completions": "generation",
    "comlrl.trainers.reinforce.magrpo:MAGRPOTrainer._compute_loss_with_gradients": "loss",
    "comlrl.trainers.reinforce.magrpo:MAGRPOTrainer._checkpoint_commit": "log/ckpt",
    "comlrl.trainers.reinforce.magrpo:MAGRPOTrainer._init_wandb": "log/ckpt",
    # both
    "comlrl.trainers.reinforce.magrpo:MAGRPOTrainer.evaluate": "evaluation",
    "transformers.generation.utils:GenerationMixin.generate": "generation",
    "wandb:log": "log/ckpt",
}


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class PhaseTimer:
    """Exclusive wall-clock time per phase, kept on a stack of active phases.

    Also charges each rise of the process's peak RSS to the phase running when it was seen, so
    the table shows which phase pushes the high-water mark up.
    """

    def __init__(self):
        self.seconds = {p: 0.0 for p in PHASES + ["other"]}
        self.calls = {p: 0 for p in PHASES}
        self.rss_growth = {p: 0.0 for p in PHASES + ["other"]}
        self.stack: list[str] = []
        self._mark = 0.0
        self._peak = _maxrss_mb()

    def _charge(self, now: float) -> None:
        if self.stack:
            self.seconds[self.stack[-1]] += now - self._mark
        self._mark = now
        peak = _maxrss_mb()
        if peak > self._peak:
            self.rss_growth[self.stack[-1] if self.stack else "other"] += peak - self._peak
            self._peak = peak

    def enter(self, phase: str) -> None:
        self._charge(time.perf_counter())
        self.stack.append(phase)
        self.calls[phase] += 1

    def exit(self) -> None:
        self._charge(time.perf_counter())
        self.stack.pop()

    def wrap(self, fn, phase: str, transparent_inside=()):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if any(p in self.stack for p in transparent_inside):
                return fn(*args, **kwargs)
            self.enter(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        timed.__comlrl_bench_wrapped__ = fn
        return timed


def _resolve(target: str):
    module_name, _, attr_path = target.partition(":")
    try:
        owner = importlib.import_module(module_name)
    except Exception:
        return None
    parts = attr_path.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    if not hasattr(owner, parts[-1]):
        return None
    return owner, parts[-1]


def install(timer: PhaseTimer, trainer) -> list[str]:
    """Wrap everything we can find; returns the targets that were patched."""
    import torch

    patched = []
    for target, phase in SPECIFIC_TARGETS.items():
        found = _resolve(target)
        if found is None:
            continue
        owner, name = found
        original = owner.__dict__.get(name, getattr(owner, name)) if isinstance(owner, type) else getattr(owner, name)
        if isinstance(original, (staticmethod, classmethod)):
            continue
        wrapped = timer.wrap(original, phase)
        setattr(owner, name, wrapped)
        patched.append(target)
        # `from module import fn` copies the binding: rebind it wherever comlrl imported it.
        if not isinstance(owner, type):
            for mod_name, mod in list(sys.modules.items()):
                if mod_name.startswith("comlrl") and getattr(mod, name, None) is original:
                    setattr(mod, name, wrapped)

    # Model forwards outside generation = the loss's log-prob pass.
    for agent in getattr(trainer, "agents", []):
        agent.forward = timer.wrap(agent.forward, "forward", transparent_inside=("generation",))
    patched.append("agent.forward (per instance)")

    torch.autograd.backward = timer.wrap(torch.autograd.backward, "backward")
    patched.append("torch.autograd.backward")

    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(lambda *a, **k: timer.enter("optimizer"))
    register_optimizer_step_post_hook(lambda *a, **k: timer.exit())
    patched.append("optimizer step hooks")
    return patched


def default_model_dir(size: str) -> str:
    try:
        return str(bench_run.model_dir(size))  # builds it with our builder (our venv only)
    except ImportError:
        found = sorted(glob.glob(str(_HERE / ".cache" / f"tiny-qwen2-{size}-*")))
        found = [f for f in found if os.path.exists(os.path.join(f, "comlrl_tiny_model.json"))]
        if not found:
            raise SystemExit(
                f"no tiny {size} model in benchmarks/.cache; run benchmarks/run.py once or pass "
                "--model-dir"
            )
        return found[-1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="per-phase time of one MAGRPO training run")
    p.add_argument("--workload", default="S-medium", choices=[*bench_run.WORKLOADS, "smoke"])
    p.add_argument("--model-dir", default=None)
    p.add_argument("--epochs", type=int, default=None, help="override the workload's epochs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pyinstrument", action="store_true", help="also a pyinstrument profile")
    p.add_argument("--cprofile", action="store_true", help="also the top functions via cProfile")
    p.add_argument("--top", type=int, default=25, help="rows of the cProfile listing")
    p.add_argument("--json-out", default=None)
    p.add_argument("--mixed-precision", default=None, help="ours only: MAGRPOConfig.mixed_precision")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    wl = bench_run.SMOKE if args.workload == "smoke" else bench_run.WORKLOADS[args.workload]
    model_dir = args.model_dir or default_model_dir(wl.size)
    epochs = args.epochs or wl.epochs

    timer = PhaseTimer()
    timed_reward = timer.wrap(workload.length_ratio_reward, "reward")
    # Keep the plain two-argument signature visible: both libraries inspect it.
    wl_args = SimpleNamespace(
        model_dir=model_dir,
        prompts=wl.prompts,
        num_generations=wl.num_generations,
        epochs=epochs,
        max_new_tokens=wl.max_new_tokens,
        seed=args.seed,
        threads=1,
        expect_library=None,
        reward_func=timed_reward,
        mixed_precision=args.mixed_precision,
    )
    trainer, _config, info = workload.setup(wl_args)
    patched = install(timer, trainer)

    profiler = None
    if args.pyinstrument:
        try:
            from pyinstrument import Profiler
        except ImportError:
            raise SystemExit(
                "pyinstrument is not installed in this venv; "
                "`pip install -c constraints.txt pyinstrument`, or use --cprofile"
            )
        profiler = Profiler(interval=0.001)
    cprof = None
    if args.cprofile:
        import cProfile

        cprof = cProfile.Profile()

    if profiler is not None:
        profiler.start()
    if cprof is not None:
        cprof.enable()
    rss_start = _maxrss_mb()
    timer._peak = rss_start
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    timer._charge(time.perf_counter())  # a final peak rise outside any phase counts as other
    if cprof is not None:
        cprof.disable()
    if profiler is not None:
        profiler.stop()
    close = getattr(trainer, "close", None)
    if callable(close):
        close()

    accounted = sum(timer.seconds[p] for p in PHASES)
    rows = [(p, timer.seconds[p], timer.calls[p], timer.rss_growth[p]) for p in PHASES]
    rows.append(("other", total - accounted, 0, timer.rss_growth["other"]))
    label = "ours" if info["library"] == "ours" else info["library"]
    print(f"\n{label} ({info['comlrl_file']}), workload {wl.name}: {wl.describe()}")
    if epochs != wl.epochs:
        print(f"(epochs overridden: {epochs})")
    if profiler is not None or cprof is not None:
        print("(a profiler was active: absolute times are inflated, shares roughly hold)")
    print(
        f"train() total: {total:.2f} s; peak RSS {rss_start:.0f} MB before, "
        f"{_maxrss_mb():.0f} MB after\n"
    )
    print("| phase | seconds | share | calls | peak RSS rise (MB) |")
    print("|---|---:|---:|---:|---:|")
    for phase, sec, calls, rss in rows:
        print(f"| {phase} | {sec:.3f} | {100 * sec / total:5.1f}% | {calls or ''} | {rss:.0f} |")
    print()

    if profiler is not None:
        print(profiler.output_text(unicode=True, color=False, show_all=False))
        html = _HERE / ".cache" / f"profile-{label}-{wl.name}.html"
        html.parent.mkdir(parents=True, exist_ok=True)
        html.write_text(profiler.output_html(), encoding="utf-8")
        print(f"pyinstrument HTML: {html}")
    if cprof is not None:
        import pstats

        pstats.Stats(cprof, stream=sys.stdout).sort_stats("cumulative").print_stats(args.top)

    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "library": info["library"],
                    "workload": wl.name,
                    "epochs": epochs,
                    "train_s": total,
                    "phases": {
                        p: {"seconds": s, "calls": c, "peak_rss_rise_mb": r} for p, s, c, r in rows
                    },
                    "patched": patched,
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
