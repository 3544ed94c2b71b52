"""Model and tokenizer loading helpers (Hydra `_target_`s) and the tiny offline test model.

`load_causal_lm` / `load_tokenizer` are thin wrappers over the `Auto*` classes so configs can name
them as `_target_`s and pass dtypes as strings. The tiny-model builders live in
`comlrl.models.tiny`; they are re-exported lazily (see `__getattr__`) so that
`python -m comlrl.models.tiny` does not import its own module twice (runpy warns about that).
"""

from __future__ import annotations

import os

__all__ = [
    "load_causal_lm",
    "load_tokenizer",
    "ensure_tiny_model",
    "tiny_model_path",
    "load_tiny_model",
    "load_tiny_tokenizer",
]

_TINY_EXPORTS = {"ensure_tiny_model", "tiny_model_path", "build_model", "build_tokenizer"}


def __getattr__(name: str):
    if name in _TINY_EXPORTS:
        from . import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _resolve_dtype(dtype):
    """Accept "float32" / "bfloat16" / "auto" / torch.dtype / None (Hydra can only pass strings)."""
    import torch

    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(resolved, torch.dtype):
            return resolved
    raise ValueError(
        f"Unsupported dtype {dtype!r}; use 'auto' or a torch dtype name such as 'float32', "
        "'bfloat16' or 'float16'."
    )


def load_causal_lm(
    name_or_path: str,
    torch_dtype=None,
    attn_implementation: str | None = None,
    **kwargs,
):
    """`AutoModelForCausalLM.from_pretrained(name_or_path, ...)` with string dtypes.

    `torch_dtype` (or `dtype`) may be a string; newer transformers renamed the argument to
    `dtype`, so it is passed under whichever name the installed version understands.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    dtype = _resolve_dtype(kwargs.pop("dtype", torch_dtype))
    if dtype is not None:
        major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
        kwargs["dtype" if (major, minor) >= (4, 56) else "torch_dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(os.fspath(name_or_path), **kwargs)


#: tokenizer_config.json classes meaning "tokenizer.json is the whole pipeline, use it as is".
_GENERIC_TOKENIZER_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def _declared_tokenizer_class(path: str) -> str | None:
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as fh:
            return json.load(fh).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def load_tokenizer(name_or_path: str, **kwargs):
    """`AutoTokenizer.from_pretrained(name_or_path, **kwargs)`, with two adjustments.

    1. A local folder whose tokenizer_config.json declares the generic fast class
       ("PreTrainedTokenizerFast"/"TokenizersBackend") is loaded with that class, i.e. exactly
       the pipeline in its tokenizer.json. transformers 5 ignores that declaration for
       model_type "qwen2" and rebuilds a `Qwen2Tokenizer` (adds an NFC normalizer and Qwen's
       split regex); for our byte-level tiny tokenizer that gives the same ids on NFC text but
       breaks exact round trips of other text. Hub ids and folders declaring a specific class
       (real Qwen2.5: "Qwen2Tokenizer") go through AutoTokenizer unchanged.
    2. Batched generation needs a pad token; base checkpoints that lack one conventionally pad
       with eos (Qwen2.5 base already does, as does our tiny tokenizer).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = os.fspath(name_or_path)
    if os.path.isdir(path) and _declared_tokenizer_class(path) in _GENERIC_TOKENIZER_CLASSES:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tiny_model(size: str = "small", root: str | os.PathLike | None = None, **kwargs):
    """The cached tiny model of `size` (built on first use), loaded with `load_causal_lm`."""
    from .tiny import tiny_model_path

    return load_causal_lm(tiny_model_path(size, root=root), **kwargs)


def load_tiny_tokenizer(size: str = "small", root: str | os.PathLike | None = None, **kwargs):
    """The byte-level tokenizer saved with the cached tiny model of `size`."""
    from .tiny import tiny_model_path

    return load_tokenizer(tiny_model_path(size, root=root), **kwargs)
