"""Prompt datasets: the seed example's four story prompts (and two held-out ones for evaluation)
and JSON/JSONL prompt files.

Files are parsed with the standard `json` module and turned into a `datasets.Dataset` in memory,
not via `datasets.load_dataset`: that keeps loading instant, writes nothing to the HF cache, and
lets every error name the file, line and field at fault.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from datasets import Dataset

__all__ = ["STORY_PROMPTS", "STORY_EVAL_PROMPTS", "story_prompts", "story_eval_prompts", "load_prompts_file"]

STORY_PROMPTS = (
    "Describe a city in the clouds:",
    "Invent a new holiday and explain it:",
    "Write a bedtime story for a dragon:",
    "Design a playground on Mars:",
)


# Held out from training: same style of task, prompts the agents never train on.
STORY_EVAL_PROMPTS = (
    "Describe a library under the sea:",
    "Write a lullaby for a robot:",
)


def story_prompts() -> Dataset:
    """The four prompts of the seed example, as a Dataset with a single "prompt" column."""
    return Dataset.from_dict({"prompt": list(STORY_PROMPTS)})


def story_eval_prompts() -> Dataset:
    """Two held-out story prompts (an eval set for `story_prompts`), one "prompt" column."""
    return Dataset.from_dict({"prompt": list(STORY_EVAL_PROMPTS)})


def _read_records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".jsonl":
        records = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue  # tolerate blank lines, e.g. a trailing newline
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg}).") from exc
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}:{lineno}: each JSONL line must be an object, got "
                    f"{type(record).__name__}."
                )
            records.append(record)
        return records

    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno}).") from exc
    if isinstance(data, list):
        for i, record in enumerate(data):
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}: item {i} is {type(record).__name__}; a JSON list must hold objects "
                    'like {"prompt": "..."}.'
                )
        return data
    if isinstance(data, dict):
        # Column form: {"prompt": [...], "other": [...]}.
        lengths = {k: len(v) for k, v in data.items() if isinstance(v, list)}
        if not lengths or len(lengths) != len(data) or len(set(lengths.values())) != 1:
            raise ValueError(
                f"{path}: a JSON object must map field names to lists of equal length "
                f'(e.g. {{"prompt": ["...", "..."]}}); got fields {sorted(data)}.'
            )
        n = next(iter(lengths.values()))
        return [{k: v[i] for k, v in data.items()} for i in range(n)]
    raise ValueError(
        f"{path}: expected a list of objects or an object of lists, got {type(data).__name__}."
    )


def load_prompts_file(
    path: str | os.PathLike,
    prompt_field: str = "prompt",
    limit: int | None = None,
) -> Dataset:
    """Load prompts from a .json or .jsonl file into a Dataset.

    Accepted layouts: a JSON list of objects, a JSON object of equal-length lists (columns), or
    JSONL with one object per line. All fields are kept (formatters may use them); the prompt
    field must exist in every record and hold a string. If `prompt_field` is not "prompt", it is
    also copied to a "prompt" column so the trainer's default formatter finds it. `limit` keeps
    the first N records.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"Prompt file not found: {os.fspath(path)!r} (resolved to {file.absolute()}). "
            f"Relative paths are resolved from the current directory ({Path.cwd()})."
        )
    if file.suffix.lower() not in (".json", ".jsonl"):
        raise ValueError(f"{file}: unsupported extension {file.suffix!r}; use .json or .jsonl.")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of records or None, got {limit}.")

    records = _read_records(file)
    if limit is not None:
        records = records[:limit]
    if not records:
        raise ValueError(f"{file}: the dataset is empty; it needs at least one prompt.")

    for i, record in enumerate(records):
        if prompt_field not in record:
            raise ValueError(
                f"{file}: record {i} has no field {prompt_field!r}; fields present: "
                f"{sorted(record)}. Pass prompt_field=<one of them>."
            )
        if not isinstance(record[prompt_field], str):
            raise ValueError(
                f"{file}: record {i} field {prompt_field!r} must be a string, got "
                f"{type(record[prompt_field]).__name__}."
            )
    if prompt_field != "prompt":
        records = [{**record, "prompt": record[prompt_field]} for record in records]
    return Dataset.from_list(records)
