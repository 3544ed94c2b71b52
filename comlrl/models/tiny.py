"""Tiny offline Qwen2-style causal LMs with a byte-level tokenizer.

Why this exists: tests, CI and the seed experiment must run on a 2-core CPU box with no model hub.
A random-init model with the same architecture family as Qwen2.5 (GQA, RMSNorm, RoPE, tied
embeddings) exercises every code path the trainer touches — batched sampling, padding, EOS
handling, log-prob gathering, save/load — in milliseconds.

The tokenizer maps every byte to its own id (id == byte value, GPT-2 byte-to-unicode alphabet, no
merges), so any unicode text round-trips and any sampled id decodes. `<|endoftext|>` (id 256) is
eos, pad and bos, as in Qwen2.5 base. The model's vocab is exactly 257 so a random policy can never
sample an id the tokenizer cannot decode.

Load it with `comlrl.models.load_tokenizer(dir)`: plain `AutoTokenizer` in transformers 5 returns a
`Qwen2Tokenizer` for any qwen2 folder, which gives the same ids on NFC-normalised text but
normalises other text (so only `load_tokenizer` round-trips every string exactly).

CLI::

    python -m comlrl.models.tiny OUT_DIR --size small|medium [--force]
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

#: Architecture of each size. Everything that shapes the weights lives here, so the cache key
#: (see `spec_hash`) changes whenever the built model would.
SIZES: dict[str, dict[str, int]] = {
    "small": dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    ),
    "medium": dict(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
    ),
}

EOS_TOKEN = "<|endoftext|>"
NUM_BYTES = 256
EOS_TOKEN_ID = NUM_BYTES  # first id after the 256 byte tokens
VOCAB_SIZE = NUM_BYTES + 1
MAX_POSITION_EMBEDDINGS = 512
SEED = 1234
#: Written last into a build; a directory without it is never treated as a model.
MARKER_FILE = "comlrl_tiny_model.json"
FORMAT_VERSION = 1
# Module init draws from the global torch RNG; two threads building at once would interleave their
# draws (fork_rng saves/restores state but does not isolate threads), so seeded init is serialised.
_INIT_LOCK = threading.Lock()


def model_spec(size: str) -> dict:
    """Everything that determines the built files for `size` (stored in the completion marker)."""
    if size not in SIZES:
        raise ValueError(f"Unknown tiny model size {size!r}; choose one of {sorted(SIZES)}.")
    return {
        "format_version": FORMAT_VERSION,
        "size": size,
        "seed": SEED,
        "vocab_size": VOCAB_SIZE,
        "eos_token_id": EOS_TOKEN_ID,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        **SIZES[size],
    }


def spec_hash(size: str) -> str:
    """Short stable hash of `model_spec(size)`, used to version cache directories."""
    blob = json.dumps(model_spec(size), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode-char map (the ByteLevel alphabet).

    Reimplemented (it is ten lines) so that token id == byte value, which the `tokenizers`
    alphabet helper does not promise (it returns an unordered collection).
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def build_tokenizer():
    """A byte-level `PreTrainedTokenizerFast` with `<|endoftext|>` as eos/pad/bos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    # BPE with no merges == one token per byte; ByteLevel maps raw bytes onto the alphabet above.
    # No normalizer on purpose: NFC (as Qwen uses) would break exact round trips of NFD text.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    assert tok.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID, tok.token_to_id(EOS_TOKEN)

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        # Qwen2.5 leaves the tokenizer's bos unset but its config says bos_token_id == eos id;
        # we set both so tokenizer and configs agree. No post-processor: nothing is prepended.
        bos_token=EOS_TOKEN,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        # Clean-up would rewrite " ." -> "." and break the round trip.
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def build_model(size: str = "small"):
    """Random-init `Qwen2ForCausalLM`, bit-identical on every call (seeded, caller RNG untouched)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = model_spec(size)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=True,  # like Qwen2.5-0.5B
        bos_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        use_sliding_window=False,
        **SIZES[size],
    )
    # fork_rng restores the global CPU RNG afterwards, so building a model inside a seeded run
    # (e.g. a test or the trainer) never shifts that run's random stream.
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = Qwen2ForCausalLM(config)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID
    )
    return model


# --------------------------------------------------------------------------------------------
# Building on disk (atomic, concurrent-safe)
# --------------------------------------------------------------------------------------------


def _publishable(root: Path) -> None:
    """Make the build readable like a normal dir and flush it before it is renamed into place.

    mkdtemp creates the dir 0700 (and safetensors may write 0600), which would hide a shared
    cache from other users; fsync ensures a published dir never holds data still in page cache.
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_marker(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MARKER_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _check_complete(out_dir: Path, size: str) -> bool:
    """True if `out_dir` holds a finished build of `size`; raise if it holds something else."""
    marker = _read_marker(out_dir)
    if marker is None:
        return False
    expected = model_spec(size)
    if marker.get("spec") != expected:
        raise RuntimeError(
            f"{out_dir} holds a different tiny model ({marker.get('spec')}) than requested "
            f"({expected}). Delete it or choose another directory."
        )
    return True


def _write_build(target: Path, size: str) -> None:
    model = build_model(size)
    tokenizer = build_tokenizer()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    # Declare the generic class: tokenizer.json is the whole pipeline. transformers 4 honours this
    # over model_type qwen2 (whose Qwen2TokenizerFast would look for vocab.json/merges.txt).
    # transformers 5 overrides it for qwen2 and rebuilds a Qwen2Tokenizer from our vocab (same
    # byte ids, plus NFC); `comlrl.models.load_tokenizer` honours the declaration on both.
    cfg_path = target / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg["clean_up_tokenization_spaces"] = False
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    # Marker last: its presence means every other file above is complete.
    marker = {"spec": model_spec(size), "spec_hash": spec_hash(size)}
    (target / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    _publishable(target)


def ensure_tiny_model(out_dir: str | os.PathLike, size: str = "small") -> str:
    """Build the tiny model + tokenizer into `out_dir` unless a complete build is already there.

    Idempotent and safe under concurrent callers (parallel test workers, sweep jobs): each caller
    builds into a private temp dir beside `out_dir` and publishes it with one atomic `os.rename`.
    If another process published first, its (bit-identical) build is used and ours is discarded.
    A directory without the completion marker is never returned.

    Returns `out_dir` as an absolute path string.
    """
    out = Path(out_dir).expanduser().resolve()
    model_spec(size)  # validate the size before touching the disk
    if _check_complete(out, size):
        return str(out)
    if out.exists() and any(out.iterdir()):
        # Our builds appear only via rename with the marker inside, so this is foreign or stale.
        # Refuse rather than delete: it might be the user's data.
        raise RuntimeError(
            f"{out} exists but is not a complete tiny model (no {MARKER_FILE}). "
            "Delete it (or pick another directory) and retry."
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_build(tmp, size)
        try:
            # Replaces an empty dir (POSIX allows it); fails if another build already landed.
            os.rename(tmp, out)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not _check_complete(out, size):
                raise
            # Another process won the race; its build is identical to ours.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def default_cache_root() -> Path:
    """Model cache root: `$COMLRL_CACHE` if set, else `~/.cache/comlrl/models`."""
    env = os.environ.get("COMLRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "comlrl" / "models"


def tiny_model_path(size: str = "small", root: str | os.PathLike | None = None) -> str:
    """Directory of a cached tiny model of `size`, built on first use.

    The directory name carries `spec_hash(size)`, so changing the architecture or seed builds a
    new cache entry instead of silently reusing a stale one.
    """
    base = Path(root).expanduser() if root is not None else default_cache_root()
    return ensure_tiny_model(base / f"tiny-qwen2-{size}-{spec_hash(size)}", size=size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m comlrl.models.tiny",
        description="Build a random-init tiny Qwen2-style model and byte-level tokenizer (offline).",
    )
    parser.add_argument("out_dir", help="Directory to write (created; left alone if already built).")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument(
        "--force", action="store_true", help="Delete OUT_DIR first and rebuild from scratch."
    )
    args = parser.parse_args(argv)
    if args.force and os.path.exists(args.out_dir):
        shutil.rmtree(args.out_dir)
    path = ensure_tiny_model(args.out_dir, size=args.size)
    print(path)


if __name__ == "__main__":
    main()
