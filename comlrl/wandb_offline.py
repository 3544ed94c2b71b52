"""Read W&B offline runs (``run-<id>.wandb`` files) without the W&B service.

W&B in offline mode writes one directory per *process*,
``wandb/offline-run-YYYYMMDD_HHMMSS-<id>[-N]/run-<id>.wandb``, even when the
process resumes an existing run id (``-N`` is appended when two segments of
the same id start within the same second). Recent wandb releases no longer
ship a Python reader for these files (``wandb sync --view`` and
``wandb/sdk/internal/datastore.py`` are gone), so this module parses them
directly. It is used by ``make sync`` and by the tests.

File format (checked against wandb's ``core/pkg/leveldb/record.go`` and the
former ``wandb/sdk/internal/datastore.py``, and against files written by
wandb 0.31):

* A 7-byte file header: ident ``b":W&B"``, magic ``0xBEE1`` (little-endian
  uint16) and version ``0`` (uint8).
* Then a LevelDB-log stream: the file is cut into 32 KiB blocks counted from
  file offset 0 (so the first block holds the file header plus 32761 bytes).
  Each block holds chunks with a 7-byte header: checksum (uint32 LE), payload
  length (uint16 LE), type (uint8: 1 FULL, 2 FIRST, 3 MIDDLE, 4 LAST),
  followed by the payload. Chunks never cross a block boundary; if fewer than
  7 bytes remain in a block they are zero padding.
* The checksum is plain CRC-32 (IEEE, ``zlib.crc32``) of the type byte
  followed by the payload, stored unmasked. (W&B's reader calls this
  ``CRCAlgoIEEE``; stock LevelDB's masked CRC-32C is *not* what W&B writes.)
* A record is one FULL chunk, or FIRST + MIDDLE* + LAST chunks; its bytes are
  a serialized ``wandb.proto.wandb_internal_pb2.Record``.

A process that is killed while writing leaves a torn tail (a partial chunk,
or a FIRST chunk whose LAST never made it). :func:`read_records` drops such a
tail silently; anything else that does not check out raises ``ValueError``.

Command line::

    python -m comlrl.wandb_offline WANDB_DIR             # list the segments
    python -m comlrl.wandb_offline WANDB_DIR --sync      # wandb sync, oldest first
    python -m comlrl.wandb_offline WANDB_DIR --sync --dry-run
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:  # wandb is imported lazily: it is slow to import.
    from wandb.proto.wandb_internal_pb2 import Record

__all__ = [
    "OfflineRun",
    "iter_records",
    "read_records",
    "read_run",
    "find_offline_runs",
    "main",
]

logger = logging.getLogger(__name__)

HEADER_IDENT = b":W&B"
HEADER_MAGIC = 0xBEE1
HEADER_VERSION = 0
HEADER_LEN = 7  # ident(4) + magic(2) + version(1)

BLOCK_LEN = 32 * 1024
CHUNK_HEADER_LEN = 7  # checksum(4) + length(2) + type(1)
_CHUNK_HEADER = struct.Struct("<IHB")

FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
# CRC-32 of the type byte, used as the seed for the payload's CRC.
_TYPE_CRC = {t: zlib.crc32(bytes([t])) for t in (FULL, FIRST, MIDDLE, LAST)}

_DIR_RE = re.compile(r"^offline-run-(\d{8}_\d{6})-(.+)$")


def _rest_is_zero(f: Any) -> bool:
    while chunk := f.read(BLOCK_LEN):
        if any(chunk):
            return False
    return True


def _iter_payloads(path: Path) -> Iterator[bytes]:
    """Yield the raw bytes of each complete record in a ``.wandb`` file."""
    with open(path, "rb") as f:
        header = f.read(HEADER_LEN)
        if len(header) < HEADER_LEN:
            raise ValueError(
                f"{path}: not a W&B transaction log: file is {len(header)} bytes, "
                f"shorter than the {HEADER_LEN}-byte header"
            )
        ident, magic, version = struct.unpack("<4sHB", header)
        if ident != HEADER_IDENT or magic != HEADER_MAGIC:
            raise ValueError(
                f"{path}: not a W&B transaction log: header is {header!r}, expected "
                f"ident {HEADER_IDENT!r} and magic 0x{HEADER_MAGIC:04X}"
            )
        if version != HEADER_VERSION:
            raise ValueError(
                f"{path}: unsupported W&B transaction log version {version} "
                f"(this reader knows version {HEADER_VERSION})"
            )

        block = header + f.read(BLOCK_LEN - HEADER_LEN)
        block_start = 0  # file offset of block[0]
        pos = HEADER_LEN  # position of the next chunk within block
        pending: bytearray | None = None  # a record begun by a FIRST chunk
        while True:
            if pos + CHUNK_HEADER_LEN > len(block):
                if len(block) < BLOCK_LEN:
                    # Final (short) block: stop. Leftover bytes are a torn
                    # chunk header.
                    if pos < len(block):
                        logger.debug("%s: torn chunk header at end of file", path)
                    break
                # The rest of a full block is zero padding (not checked: the
                # chunk CRCs already protect the data).
                block_start += BLOCK_LEN
                block = f.read(BLOCK_LEN)
                pos = 0
                if not block:
                    break
                continue

            checksum, length, ctype = _CHUNK_HEADER.unpack_from(block, pos)
            offset = block_start + pos
            if checksum == 0 and length == 0 and ctype == 0:
                # Zeroed space (pre-allocated or never written). Legitimate
                # only as the tail of the file.
                if any(block[pos:]) or not _rest_is_zero(f):
                    raise ValueError(f"{path}: zeroed chunk in the middle of the file at offset {offset}")
                logger.debug("%s: zero-filled tail at offset %d", path, offset)
                break
            end = pos + CHUNK_HEADER_LEN + length
            if end > BLOCK_LEN:
                raise ValueError(f"{path}: corrupt chunk at offset {offset}: length {length} crosses the block end")
            if end > len(block):
                # The chunk runs past the end of the file: a torn write.
                logger.debug("%s: torn chunk at offset %d (end of file)", path, offset)
                break
            if ctype not in _TYPE_CRC:
                raise ValueError(f"{path}: corrupt chunk at offset {offset}: unknown chunk type {ctype}")
            payload = block[pos + CHUNK_HEADER_LEN : end]
            if zlib.crc32(payload, _TYPE_CRC[ctype]) != checksum:
                raise ValueError(f"{path}: corrupt chunk at offset {offset}: checksum mismatch")
            pos = end

            if ctype == FULL:
                if pending is not None:
                    raise ValueError(f"{path}: corrupt log at offset {offset}: FULL chunk inside a multi-chunk record")
                yield payload
            elif ctype == FIRST:
                if pending is not None:
                    raise ValueError(f"{path}: corrupt log at offset {offset}: FIRST chunk inside a multi-chunk record")
                pending = bytearray(payload)
            else:  # MIDDLE or LAST
                if pending is None:
                    name = "MIDDLE" if ctype == MIDDLE else "LAST"
                    raise ValueError(f"{path}: corrupt log at offset {offset}: {name} chunk without a FIRST chunk")
                pending += payload
                if ctype == LAST:
                    yield bytes(pending)
                    pending = None
        if pending is not None:
            logger.debug("%s: incomplete multi-chunk record at end of file", path)


def iter_records(path: str | os.PathLike[str]) -> Iterator["Record"]:
    """Yield each complete ``Record`` protobuf of a ``.wandb`` file, in order.

    Raises ``ValueError`` for a bad file header or a corrupt chunk; a torn
    tail left by a killed process is ignored.
    """
    from google.protobuf.message import DecodeError
    from wandb.proto.wandb_internal_pb2 import Record

    path = Path(path)
    for i, payload in enumerate(_iter_payloads(path)):
        record = Record()
        try:
            record.ParseFromString(payload)
        except DecodeError as e:
            raise ValueError(f"{path}: record #{i} is not a valid wandb Record protobuf: {e}") from e
        yield record


def read_records(path: str | os.PathLike[str]) -> list["Record"]:
    """All complete ``Record`` protobufs of a ``.wandb`` file (see :func:`iter_records`)."""
    return list(iter_records(path))


@dataclass
class OfflineRun:
    """One offline segment (one process) of a W&B run."""

    path: Path  #: the ``run-<id>.wandb`` file
    run_id: str
    project: str = ""
    entity: str = ""
    name: str = ""  #: display name
    start_time: float | None = None  #: seconds since the epoch, from the run record
    resumed: bool = False  #: the process called ``wandb.init(resume=...)``
    finished: bool = False  #: an exit record was written (the process did not die)
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return self.path.parent

    @property
    def steps(self) -> list[int]:
        """The ``_step`` of every history row, in file order."""
        return [row["_step"] for row in self.history if "_step" in row]

    @property
    def synced(self) -> bool:
        """Whether ``wandb sync`` left its ``.synced`` marker (it does not always)."""
        return self.path.with_name(self.path.name + ".synced").exists()


def _json(value_json: str) -> Any:
    return json.loads(value_json) if value_json else None


def _item_path(item: Any) -> list[str]:
    return [item.key] if item.key else list(item.nested_key)


def _set_nested(d: dict[str, Any], keys: Sequence[str], value: Any) -> None:
    for k in keys[:-1]:
        child = d.get(k)
        if not isinstance(child, dict):
            child = d[k] = {}
        d = child
    d[keys[-1]] = value


def _del_nested(d: dict[str, Any], keys: Sequence[str]) -> None:
    for k in keys[:-1]:
        d = d.get(k)
        if not isinstance(d, dict):
            return
    d.pop(keys[-1], None)


def _apply(target: dict[str, Any], update: Any) -> None:
    """Apply a ConfigRecord / SummaryRecord (``update`` and ``remove`` items)."""
    for item in update.update:
        keys = _item_path(item)
        if keys:
            _set_nested(target, keys, _json(item.value_json))
    for item in update.remove:
        keys = _item_path(item)
        if keys:
            _del_nested(target, keys)


def _wandb_file(path: Path) -> Path:
    if path.is_dir():
        files = sorted(path.glob("run-*.wandb"))
        if len(files) != 1:
            raise ValueError(f"{path}: expected exactly one run-*.wandb file, found {len(files)}")
        return files[0]
    return path


def read_run(path: str | os.PathLike[str]) -> OfflineRun:
    """Decode one offline segment: a run directory or its ``run-<id>.wandb`` file.

    ``history`` has one dict per history record: ``_step``, ``_runtime``,
    ``_timestamp`` and the logged keys, with values decoded from JSON (keys of
    nested dicts are joined with ``.``, as W&B shows them). ``config`` and
    ``summary`` are the result of applying the config/summary updates in order
    (nested keys become nested dicts).
    """
    wandb_file = _wandb_file(Path(path))
    stem = wandb_file.stem
    run = OfflineRun(path=wandb_file, run_id=stem[len("run-") :] if stem.startswith("run-") else stem)
    for record in iter_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.run_id = r.run_id or run.run_id
            run.project, run.entity, run.name = r.project, r.entity, r.display_name
            run.resumed = bool(r.resume)
            if r.HasField("start_time"):
                run.start_time = r.start_time.seconds + r.start_time.nanos / 1e9
            _apply(run.config, r.config)
            _apply(run.summary, r.summary)
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                row[".".join(_item_path(item))] = _json(item.value_json)
            if "_step" not in row and record.history.HasField("step"):
                row["_step"] = record.history.step.num
            run.history.append(row)
        elif kind == "config":
            _apply(run.config, record.config)
        elif kind == "summary":
            _apply(run.summary, record.summary)
        elif kind == "exit":
            run.finished = True
    return run


def _wandb_root(wandb_dir: Path) -> Path:
    """Accept either a ``wandb/`` dir or the directory containing one."""
    nested = wandb_dir / "wandb"
    if nested.is_dir() and not any(wandb_dir.glob("offline-run-*")):
        return nested
    return wandb_dir


def _sort_key(run: OfflineRun) -> tuple[str, float, int, str]:
    name = run.run_dir.name
    m = _DIR_RE.match(name)
    stamp = m.group(1) if m else ""
    # W&B appends -1, -2, ... when a directory for the same second and id exists.
    base = f"offline-run-{stamp}-{run.run_id}"
    rest = name[len(base) :]
    suffix = int(rest[1:]) if name.startswith(base) and rest[1:].isdigit() else 0
    start = run.start_time if run.start_time is not None else math.inf
    return (stamp, start, suffix, name)


def find_offline_runs(wandb_dir: str | os.PathLike[str]) -> list[OfflineRun]:
    """All offline segments under ``wandb_dir``, oldest first.

    Order: the timestamp in the directory name (``offline-run-YYYYMMDD_HHMMSS-
    <id>``), then the run record's start time, W&B's ``-N`` collision suffix
    and the name. Directories without a ``run-*.wandb`` file are skipped.
    """
    root = _wandb_root(Path(wandb_dir))
    runs = []
    for run_dir in root.glob("offline-run-*"):
        if run_dir.is_dir() and not run_dir.is_symlink() and any(run_dir.glob("run-*.wandb")):
            runs.append(read_run(run_dir))
    return sorted(runs, key=_sort_key)


def _default_wandb_exe() -> str:
    # Prefer the CLI of the interpreter's own environment (the project venv).
    exe = Path(sys.executable).parent / "wandb"
    if exe.exists():
        return str(exe)
    return shutil.which("wandb") or "wandb"


def _describe(run: OfflineRun) -> str:
    steps = run.steps
    span = f"{min(steps)}..{max(steps)}" if steps else "-"
    state = "finished" if run.finished else "no exit record (killed or still running)"
    flags = ", resumed" if run.resumed else ""
    flags += ", synced" if run.synced else ""
    return (
        f"{run.run_dir.name}: id={run.run_id} project={run.project or '-'} "
        f"steps={span} rows={len(run.history)} [{state}{flags}]"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m comlrl.wandb_offline",
        description="List W&B offline run segments and optionally upload them with `wandb sync`, oldest first.",
    )
    parser.add_argument("wandb_dir", type=Path, help="a wandb/ directory, or the directory that contains it")
    parser.add_argument(
        "--sync",
        action="store_true",
        help="run `wandb sync <segment dir>` for each segment, oldest first, stopping at the first failure",
    )
    parser.add_argument("--dry-run", action="store_true", help="with --sync: print the commands, run nothing")
    parser.add_argument(
        "--skip-synced",
        action="store_true",
        help="with --sync: leave out segments that carry wandb's .synced marker",
    )
    parser.add_argument("--wandb-exe", default=None, help="the wandb CLI to call (default: the one next to python)")
    args = parser.parse_args(argv)

    if not args.wandb_dir.is_dir():
        parser.error(f"{args.wandb_dir} is not a directory")
    runs = find_offline_runs(args.wandb_dir)
    root = _wandb_root(args.wandb_dir)
    print(f"{len(runs)} offline run segment(s) in {root}, oldest first:")
    for run in runs:
        print("  " + _describe(run))
    if not args.sync:
        return 0

    todo = [r for r in runs if not (args.skip_synced and r.synced)]
    if not todo:
        print("Nothing to sync.")
        return 0
    exe = args.wandb_exe or _default_wandb_exe()
    commands = [[exe, "sync", str(r.run_dir)] for r in todo]
    print(
        f"{'Would run' if args.dry_run else 'Running'} {len(commands)} `wandb sync` command(s), "
        "oldest segment first so that steps reach W&B in increasing order:"
    )
    for cmd in commands:
        print("  " + " ".join(cmd))
    if args.dry_run:
        return 0
    for i, cmd in enumerate(commands, 1):
        print(f"[{i}/{len(commands)}] {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            print(f"wandb sync failed (exit {rc}); stopping so later segments are not uploaded out of order.")
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
