"""One MAGRPO training run, timed. Runs unchanged under EITHER library.

Both our package and CoMLRL 1.4.3 (PyPI) import as ``comlrl``; this script only touches the
public API the two share::

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    MAGRPOTrainer(agents=[...], tokenizer=tok, reward_func=..., train_dataset=ds,
                  args=MAGRPOConfig(...), wandb_config=None).train()

Which library it measures is decided by the interpreter that runs it (``benchmarks/run.py``
starts it with ``/work/main/.venv`` for ours and ``benchmarks/.venv-ref`` for CoMLRL), so it
must import nothing else from ``comlrl`` (e.g. not ``comlrl.models``, which CoMLRL lacks).

Timed: ``trainer.train()`` only (wall clock, ``time.perf_counter``; also its process CPU time). Not timed: imports, model
and tokenizer loading, dataset and trainer construction, ``trainer.close()``.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/workload.py --model-dir DIR --prompts 4 \
        --num-generations 4 --epochs 4 --seed 0 --json-out result.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# benchmarks/profile.py would shadow the standard library's `profile` module (which `cProfile`,
# and through it torch/transformers, import) while this folder is sys.path[0]. Drop the folder.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse
import gc
import importlib.metadata
import inspect
import json
import math
import os
import platform
import random
import resource
import time

# The caller sets these too; setting them before torch is imported makes a bare run comparable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED_PROMPTS = [
    "Describe a city in the clouds:",
    "Invent a new holiday and explain it:",
    "Write a bedtime story for a dragon:",
    "Design a playground on Mars:",
]

# Prompt i >= 4 is TEMPLATES[i % 4] filled with SUBJECTS[(i // 4 - 1) % len(SUBJECTS)]; past
# 4 * (1 + len(SUBJECTS)) prompts an index suffix keeps them distinct. Deterministic, no RNG.
_TEMPLATES = [
    "Describe {}:",
    "Invent a new holiday about {} and explain it:",
    "Write a bedtime story about {}:",
    "Design a playground for {}:",
]
_SUBJECTS = [
    "a lighthouse keeper",
    "an underwater library",
    "a clockwork fox",
    "the last tree on a desert island",
    "a market that only opens at midnight",
    "a robot learning to paint",
    "a village built on the back of a whale",
    "a train that travels between seasons",
]


def make_prompts(n: int) -> list[str]:
    """The seed example's four prompts, then distinct deterministic variations."""
    if n < 1:
        raise ValueError("need at least one prompt")
    prompts: list[str] = []
    for i in range(n):
        if i < len(SEED_PROMPTS):
            prompts.append(SEED_PROMPTS[i])
            continue
        cycle, slot = divmod(i, len(_TEMPLATES))
        subject = _SUBJECTS[(cycle - 1) % len(_SUBJECTS)]
        text = _TEMPLATES[slot].format(subject)
        rounds = (cycle - 1) // len(_SUBJECTS)
        if rounds:
            text = f"{text[:-1]} (variation {rounds}):"
        prompts.append(text)
    assert len(set(prompts)) == n
    return prompts


def length_ratio_reward(completions1, completions2):
    """1.0 when len(c2)/max(len(c1),1) lies in [2, 3], else exp(-distance to nearest bound)."""
    rewards = []
    for first, second in zip(completions1, completions2):
        ratio = len(second) / max(len(first), 1)
        distance = 0.0 if 2.0 <= ratio <= 3.0 else min(abs(ratio - 2.0), abs(ratio - 3.0))
        rewards.append(math.exp(-distance))
    return rewards


def load_tokenizer(path: str):
    """Load the tiny byte-level tokenizer exactly as our `comlrl.models.load_tokenizer` does.

    transformers 5 ignores tokenizer_config's "PreTrainedTokenizerFast" for model_type qwen2 and
    rebuilds a Qwen2Tokenizer (adds NFC); both libraries get the same plain fast tokenizer here.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    declared = None
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as fh:
            declared = json.load(fh).get("tokenizer_class")
    except (OSError, ValueError):
        pass
    if declared in {"PreTrainedTokenizerFast", "TokenizersBackend"}:
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def _proc_kb_field_mb(path: str, field: str) -> float:
    """A "<field>: <n> kB" line of a /proc file, in MB; 0.0 where unavailable."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def _rss_mb() -> float:
    """Current resident set size (MB)."""
    return _proc_kb_field_mb("/proc/self/status", "VmRSS")


def _file_huge_pages_mb() -> float:
    """Resident file-backed huge pages (MB, `FilePmdMapped`). Where the kernel maps a shared
    library's text with 2 MB pages (e.g. one venv's copy of libtorch_cpu.so), all of each page counts
    as resident: RSS rises by up to ~100 MB that is not the workload's memory. Reported so that a
    peak RSS comparison can see it."""
    return _proc_kb_field_mb("/proc/self/smaps_rollup", "FilePmdMapped")


def _peak_rss_mb() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def detect_library(comlrl_module) -> tuple[str, str]:
    """("ours" | "comlrl-<version>", version). CoMLRL is the PyPI dist living in site-packages."""
    try:
        version = importlib.metadata.version("comlrl")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(comlrl_module, "__version__", "unknown")
    path = os.path.realpath(getattr(comlrl_module, "__file__", "") or "")
    in_site_packages = f"{os.sep}site-packages{os.sep}" in path
    if in_site_packages and version.startswith("1."):
        return f"comlrl-{version}", version
    return "ours", version


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="tiny model dir (from comlrl.models.tiny)")
    p.add_argument("--prompts", type=int, default=4, help="number of training prompts")
    p.add_argument("--num-generations", type=int, default=4, help="K samples per prompt")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json-out", default=None, help="also write the result JSON here")
    p.add_argument(
        "--mixed-precision",
        default=None,
        help="ours only: MAGRPOConfig.mixed_precision ('no', 'bf16', 'auto'); CoMLRL 1.4.3 has no such "
        "setting and always computes in the model's dtype (fp32 here)",
    )
    p.add_argument(
        "--expect-library",
        choices=["ours", "reference"],
        default=None,
        help="fail unless `comlrl` resolves to this library (guards against a leaked sys.path)",
    )
    return p.parse_args(argv)


def setup(args):
    """Seed, load the agents and tokenizer, build the dataset and trainer (the untimed part).

    Returns (trainer, config, info) where info holds what the result JSON reports about setup.
    """
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (only possible before any parallel work)
        pass

    import comlrl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    library, version = detect_library(comlrl)
    if getattr(args, "expect_library", None) is not None:
        got = "ours" if library == "ours" else "reference"
        if got != args.expect_library:
            raise SystemExit(
                f"expected {args.expect_library} but `comlrl` is {library} ({version}) "
                f"from {comlrl.__file__}"
            )

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    setup_t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.model_dir)
    agents = [AutoModelForCausalLM.from_pretrained(args.model_dir) for _ in range(2)]
    prompts = make_prompts(args.prompts)
    dataset = Dataset.from_dict({"prompt": prompts})

    config_kwargs = dict(
        num_turns=1,
        num_train_epochs=args.epochs,
        num_generations=args.num_generations,
        max_new_tokens=args.max_new_tokens,
        logging_steps=1,
    )
    # CoMLRL 1.4.3's MAGRPOConfig has no `seed`; ours does. Pass it only where it exists so the
    # sampling/learning settings (temperature 0.6, top_p 0.6, top_k 50, lr, buffer sizes) stay
    # at each library's defaults, which are the same.
    try:
        config_params = inspect.signature(MAGRPOConfig).parameters
    except (TypeError, ValueError):
        config_params = {}
    if "seed" in config_params:
        config_kwargs["seed"] = args.seed
    mixed_precision = getattr(args, "mixed_precision", None)
    if mixed_precision is not None:
        if "mixed_precision" not in config_params:
            raise SystemExit(f"--mixed-precision {mixed_precision}: this library ({library}) has no such setting")
        config_kwargs["mixed_precision"] = mixed_precision
    config = MAGRPOConfig(**config_kwargs)

    trainer = MAGRPOTrainer(
        agents=agents,
        tokenizer=tokenizer,
        reward_func=reward_func_for(args),
        train_dataset=dataset,
        args=config,
        wandb_config=None,
    )
    info = {
        "library": library,
        "comlrl_version": version,
        "comlrl_file": os.path.realpath(comlrl.__file__),
        "seed_passed_to_config": "seed" in config_kwargs,
        "mixed_precision": config_kwargs.get("mixed_precision"),
        "setup_s": time.perf_counter() - setup_t0,
    }
    return trainer, config, info


def reward_func_for(args):
    """The reward handed to the trainer (profile.py swaps in a timed wrapper)."""
    return getattr(args, "reward_func", None) or length_ratio_reward


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    import transformers

    trainer, config, info = setup(args)
    gc.collect()
    rss_before_train = _rss_mb()
    peak_before_train = _peak_rss_mb()

    # ---- timed ---------------------------------------------------------------------------------
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train()
    train_s = time.perf_counter() - t0
    train_cpu_s = time.process_time() - c0
    # ---------------------------------------------------------------------------------------------

    peak_rss = _peak_rss_mb()
    close = getattr(trainer, "close", None)
    if callable(close):
        close()

    def _cfg(name):
        value = getattr(config, name, None)
        return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)

    result = {
        **info,
        "python": sys.executable,
        "train_s": train_s,
        # CPU seconds of this process (all threads) during train(): with one torch thread it is
        # close to train_s on an idle machine and much less sensitive to other load.
        "train_cpu_s": train_cpu_s,
        "train_s_per_epoch": train_s / args.epochs,
        "peak_rss_mb": peak_rss,
        "peak_rss_before_train_mb": peak_before_train,
        "rss_before_train_mb": rss_before_train,
        "file_huge_pages_mb": _file_huge_pages_mb(),
        "epochs": args.epochs,
        "prompts": args.prompts,
        "num_generations": args.num_generations,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "model_dir": os.path.realpath(args.model_dir),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "sampling": {k: _cfg(k) for k in ("temperature", "top_p", "top_k")},
        "config": {
            k: _cfg(k)
            for k in (
                "agent_learning_rate",
                "rollout_buffer_size",
                "train_batch_size",
                "advantage_mode",
                "advantage_normalization",
                "joint_mode",
                "eval_interval",
            )
        },
    }
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
