"""Tokens per second of our sampling and policy-gradient update at a real model's shape.

Builds a random-init Qwen2 model with the shape of a released checkpoint (the numbers of its
config.json, embedded below: nothing is downloaded) and times, for one agent, the two phases of a
MAGRPO update with the library's own functions:

* generation: `comlrl.rollout.sample_completions` (batched keyed sampling, KV cache, lean decode;
  on CUDA each decode step is a CUDA graph replay unless COMLRL_CUDA_GRAPHS=0);
* update: `shared_prompt_token_logprobs` forward, `policy_gradient_loss`, backward, AdamW step,
  under the trainer's precision handling (`comlrl.precision`).

Each precision runs one warm-up round, then `--repeats` timed rounds (median reported). Runs on
CUDA when available, else on the CPU (one torch thread, like `run.py`; use `--layers` there to
keep a run short: the per-layer figures scale).

    .venv/bin/python benchmarks/throughput.py                                  # qwen2.5-0.5b, auto device
    .venv/bin/python benchmarks/throughput.py --shape qwen2.5-1.5b --precision no,bf16
    .venv/bin/python benchmarks/throughput.py --device cpu --layers 4 --json-out /tmp/t.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # benchmarks/profile.py shadows `profile`
sys.path.insert(0, str(_HERE.parent))

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

# config.json of the released checkpoints (architecture numbers only).
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, rope_theta=1e6),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers (shorter CPU runs)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--precision", default="no,bf16", help="comma list of mixed_precision settings")
    p.add_argument("--prompts", type=int, default=None, help="prompts per update (default 8 on GPU, 2 on CPU)")
    p.add_argument("--num-generations", type=int, default=4, help="K samples per prompt")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128 on GPU, 32 on CPU")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds after one warm-up")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, Qwen2Config

    from comlrl.losses import completion_mask, policy_gradient_loss, shared_prompt_token_logprobs
    from comlrl.models import load_tokenizer, tiny_model_path
    from comlrl.precision import compute_dtype
    from comlrl.rollout import SamplingSettings, sample_completions, use_cuda_graphs

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    prompts_per_update = args.prompts or (8 if on_gpu else 2)
    max_new = args.max_new_tokens or (128 if on_gpu else 32)
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    config = Qwen2Config(**shape, rms_norm_eps=1e-6, max_position_embeddings=32768, hidden_act="silu",
                         bos_token_id=256, eos_token_id=256, pad_token_id=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    # The byte-level tokenizer of the tiny models encodes the prompts (ids < 257 exist in every
    # vocabulary); ids it does not know are dropped when completions are decoded to text.
    tokenizer = load_tokenizer(tiny_model_path("small"))
    prompt_text = ("Cooperative agents write a story together, one paragraph each. " * 64)[: args.prompt_tokens]
    prompts = [f"{i}:{prompt_text}"[: args.prompt_tokens] for i in range(prompts_per_update)]
    settings = SamplingSettings(num_generations=args.num_generations, max_new_tokens=max_new, temperature=0.6,
                                top_p=0.6, top_k=50)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-6)
    k = args.num_generations

    results = {}
    for setting in [s.strip() for s in args.precision.split(",") if s.strip()]:
        dtype = compute_dtype(setting, device)
        rounds = []
        for round_index in range(args.repeats + 1):
            keys = [(setting, round_index, i) for i in range(len(prompts))]
            _sync(device)
            t0 = time.perf_counter()
            samples = sample_completions(model, tokenizer, prompts, settings, keys=keys, compute_dtype=dtype)
            _sync(device)
            t1 = time.perf_counter()
            # Sampling runs under inference_mode; the trainer's row selection copies its tensors out.
            completion_ids, prompt_ids, prompt_mask = (t.clone() for t in (
                samples.completion_ids, samples.prompt_ids, samples.prompt_mask))
            mask = completion_mask(completion_ids, [256])
            advantages = torch.randn(mask.shape[0], device=device)
            logprobs = shared_prompt_token_logprobs(model, prompt_ids, prompt_mask, completion_ids, mask, k, dtype)
            loss = policy_gradient_loss(logprobs, mask, advantages)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            t2 = time.perf_counter()
            generated = int(samples.completion_ids.numel())  # rows x decode steps (rows pad after EOS)
            trained = int(mask.sum()) + int(samples.prompt_mask.sum())
            rounds.append({"generation_s": t1 - t0, "update_s": t2 - t1, "generated_tokens": generated,
                           "trained_tokens": trained})
        timed = rounds[1:]
        gen_s = statistics.median(r["generation_s"] for r in timed)
        upd_s = statistics.median(r["update_s"] for r in timed)
        results[setting] = {
            "compute_dtype": str(dtype or next(model.parameters()).dtype).replace("torch.", ""),
            "generation_s": gen_s,
            "update_s": upd_s,
            "generation_tokens_per_s": statistics.median(r["generated_tokens"] / r["generation_s"] for r in timed),
            "update_tokens_per_s": statistics.median(r["trained_tokens"] / r["update_s"] for r in timed),
            "peak_memory_mb": _peak_memory_mb(device),
            "warmup": rounds[0],
            "rounds": timed,
        }

    device_name = torch.cuda.get_device_name(device) if on_gpu else _cpu_name()
    summary = {
        "shape": args.shape, "layers": shape["num_hidden_layers"], "parameters": parameters,
        "device": str(device), "device_name": device_name, "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "prompts_per_update": prompts_per_update, "num_generations": k, "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": max_new, "cuda_graphs": use_cuda_graphs(device, max_new), "results": results,
    }
    print(f"{args.shape} shape, {shape['num_hidden_layers']} layers ({parameters / 1e6:.0f}M parameters), "
          f"{device} ({device_name}), {prompts_per_update} prompts x K={k}, {args.prompt_tokens}-token prompts, "
          f"{max_new} new tokens{'; decode by CUDA graph replay' if summary['cuda_graphs'] else ''}; "
          f"median of {args.repeats} after a warm-up\n")
    print("| mixed_precision | products | generation (tokens/s) | update (tokens/s) | generation (s) | update (s) | peak memory (MB) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for setting, r in results.items():
        print(f"| {setting} | {r['compute_dtype']} | {r['generation_tokens_per_s']:.1f} | {r['update_tokens_per_s']:.1f} | "
              f"{r['generation_s']:.2f} | {r['update_s']:.2f} | {r['peak_memory_mb']:.0f} |")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


if __name__ == "__main__":
    main()
