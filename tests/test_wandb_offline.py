"""comlrl.wandb_offline against real W&B offline runs written by subprocesses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb")

from comlrl import wandb_offline as wo  # noqa: E402

pytestmark = pytest.mark.slow

RUN_ID = "abcd1234"
BIG_ID = "bigrec01"
BLOB_LEN = 70_000  # > two 32 KiB blocks: records carrying it need FIRST/MIDDLE/LAST chunks

# argv: run_id first_step last_step resume(""|"allow") blob_len
LOGGER = """
import sys, wandb
run_id, first, last, resume, blob = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] or None, int(sys.argv[5])
run = wandb.init(project="p", id=run_id, name="seg", mode="offline", resume=resume, config={"lr": 0.1})
for step in range(first, last + 1):
    row = {"x": step * 0.5, "name": "a"}
    if blob:
        row["blob"] = "y" * blob
    run.log(row, step=step)
run.finish()
"""


def _log(wandb_dir: Path, run_id: str, first: int, last: int, resume: str = "", blob: int = 0) -> None:
    env = dict(os.environ)
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(wandb_dir),
        WANDB_CONFIG_DIR=str(wandb_dir / ".config"),
        WANDB_CACHE_DIR=str(wandb_dir / ".cache"),
        WANDB_DATA_DIR=str(wandb_dir / ".data"),
        OMP_NUM_THREADS="1",
    )
    subprocess.run(
        [sys.executable, "-c", LOGGER, run_id, str(first), str(last), resume, str(blob)],
        cwd=wandb_dir,
        env=env,
        check=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def resumed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two processes, same run id: steps 1..5, then resume="allow" and steps 3..8."""
    d = tmp_path_factory.mktemp("resumed")
    _log(d, RUN_ID, 1, 5)
    _log(d, RUN_ID, 3, 8, resume="allow")
    return d


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run whose file spans several 32 KiB blocks."""
    d = tmp_path_factory.mktemp("big")
    _log(d, BIG_ID, 1, 3, blob=BLOB_LEN)
    (path,) = (d / "wandb").glob(f"offline-run-*-{BIG_ID}/run-{BIG_ID}.wandb")
    return path


def _rows(run: wo.OfflineRun) -> list[dict]:
    """History rows without W&B's wall-clock keys (checked separately)."""
    for row in run.history:
        assert isinstance(row["_runtime"], (int, float))
        assert isinstance(row["_timestamp"], (int, float))
    return [{k: v for k, v in row.items() if k not in ("_runtime", "_timestamp")} for row in run.history]


def test_resumed_id_gives_two_segments_with_exact_history(resumed_dir: Path) -> None:
    runs = wo.find_offline_runs(resumed_dir)
    assert len(runs) == 2
    first, second = runs
    # One directory per process, even though the id is the same.
    assert first.run_dir != second.run_dir
    assert first.run_dir.name.startswith("offline-run-") and first.run_dir.name.endswith(RUN_ID)
    assert second.run_dir.name.startswith("offline-run-") and RUN_ID in second.run_dir.name
    assert first.run_id == second.run_id == RUN_ID
    assert (first.project, first.name) == (second.project, second.name) == ("p", "seg")
    assert (first.resumed, second.resumed) == (False, True)
    assert first.finished and second.finished
    assert first.start_time < second.start_time

    assert _rows(first) == [{"_step": s, "x": s * 0.5, "name": "a"} for s in range(1, 6)]
    # What offline W&B really does with the resumed id (wandb 0.31): the second
    # process knows nothing about the first segment (no server to ask for the
    # last step), so it starts a fresh segment and writes every step it is
    # given, including 3..5 that overlap segment 1. Nothing is dropped or
    # renumbered locally; overlaps only meet at `wandb sync` time.
    # (Within one process, a step lower than the current one *is* dropped by
    # the SDK with "ignoring partial history record".)
    assert _rows(second) == [{"_step": s, "x": s * 0.5, "name": "a"} for s in range(3, 9)]
    assert first.steps == [1, 2, 3, 4, 5] and second.steps == [3, 4, 5, 6, 7, 8]

    for run, last in ((first, 5), (second, 8)):
        assert {k: v for k, v in run.config.items() if k != "_wandb"} == {"lr": 0.1}
        assert run.summary["_step"] == last
        assert run.summary["x"] == last * 0.5
        assert run.summary["name"] == "a"


def test_accepts_wandb_dir_run_dir_and_file(resumed_dir: Path) -> None:
    via_parent = wo.find_offline_runs(resumed_dir)
    via_wandb = wo.find_offline_runs(resumed_dir / "wandb")
    assert [r.path for r in via_parent] == [r.path for r in via_wandb]
    seg = via_parent[1]
    for p in (seg.run_dir, seg.path, str(seg.path)):
        assert wo.read_run(p).history == seg.history


def test_records_are_wandb_protobufs(resumed_dir: Path) -> None:
    path = wo.find_offline_runs(resumed_dir)[0].path
    assert path.read_bytes()[:7] == b":W&B\xe1\xbe\x00"  # ident, magic 0xBEE1 LE, version 0
    records = wo.read_records(path)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds[0] == "header"
    assert kinds.count("run") == 1 and kinds.count("history") == 5
    assert kinds[-1] == "exit"


def test_multi_block_record(big_file: Path) -> None:
    assert big_file.stat().st_size > 6 * wo.BLOCK_LEN
    run = wo.read_run(big_file)
    assert _rows(run) == [{"_step": s, "x": s * 0.5, "name": "a", "blob": "y" * BLOB_LEN} for s in (1, 2, 3)]


def test_truncated_file_reads_records_before_the_cut(big_file: Path, tmp_path: Path) -> None:
    data = big_file.read_bytes()
    full = [r.SerializeToString() for r in wo.read_records(big_file)]
    block = wo.BLOCK_LEN
    cuts = sorted(
        {7, 8, 20, block - 1, block, block + 1, block + 1000, 2 * block + 5, len(data) - 1}
        | set(range(7, len(data), len(data) // 150))
    )
    cut_file = tmp_path / "run-cut.wandb"
    prev = 0
    for cut in cuts:
        cut_file.write_bytes(data[:cut])
        got = [r.SerializeToString() for r in wo.read_records(cut_file)]
        # Always a prefix of the complete file's records, never shrinking as the cut moves on.
        assert got == full[: len(got)], cut
        assert len(got) >= prev, cut
        prev = len(got)
    assert prev < len(full)

    # A cut in the middle of the second block lands inside the first record
    # that carries the blob (W&B writes step 1's summary update, then its
    # history row, each ~70 KB): the records before it are all there.
    cut_file.write_bytes(data[: block + block // 2])
    kinds = [r.WhichOneof("record_type") for r in wo.read_records(cut_file)]
    assert kinds and "history" not in kinds and "run" in kinds
    run = wo.read_run(cut_file)
    assert run.run_id == BIG_ID and run.history == [] and not run.finished


def test_zero_filled_tail_is_ignored(big_file: Path, tmp_path: Path) -> None:
    padded = tmp_path / "run-pad.wandb"
    padded.write_bytes(big_file.read_bytes() + bytes(5000))
    assert [r.SerializeToString() for r in wo.read_records(padded)] == [
        r.SerializeToString() for r in wo.read_records(big_file)
    ]


def test_bad_header_raises(tmp_path: Path) -> None:
    bad = tmp_path / "run-bad.wandb"
    bad.write_bytes(b"LEVELDB" + bytes(100))
    with pytest.raises(ValueError, match="not a W&B transaction log"):
        wo.read_records(bad)
    bad.write_bytes(b":W&")
    with pytest.raises(ValueError, match="shorter than"):
        wo.read_records(bad)
    bad.write_bytes(b":W&B\xe1\xbe\x07")
    with pytest.raises(ValueError, match="version 7"):
        wo.read_records(bad)


def test_corrupt_chunk_raises(resumed_dir: Path, tmp_path: Path) -> None:
    data = bytearray(wo.find_offline_runs(resumed_dir)[0].path.read_bytes())
    data[7 + 7 + 3] ^= 0xFF  # a byte inside the first chunk's payload
    bad = tmp_path / "run-corrupt.wandb"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        wo.read_records(bad)


def test_cli_lists_and_syncs_oldest_first(resumed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    runs = wo.find_offline_runs(resumed_dir)
    assert wo.main([str(resumed_dir)]) == 0
    out = capsys.readouterr().out
    assert "2 offline run segment(s)" in out
    assert f"id={RUN_ID} project=p steps=1..5 rows=5" in out
    assert f"id={RUN_ID} project=p steps=3..8 rows=6" in out

    # A stand-in for the wandb CLI that records its arguments: no network.
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "fake-wandb"
    fake.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    fake.chmod(0o755)

    assert wo.main([str(resumed_dir), "--sync", "--dry-run", "--wandb-exe", str(fake)]) == 0
    out = capsys.readouterr().out
    assert "Would run 2" in out and not calls.exists()
    lines = [line.strip() for line in out.splitlines()]
    expected = [f"{fake} sync {r.run_dir}" for r in runs]
    assert lines.index(expected[0]) < lines.index(expected[1])

    assert wo.main([str(resumed_dir / "wandb"), "--sync", "--wandb-exe", str(fake)]) == 0
    assert calls.read_text().splitlines() == [f"sync {r.run_dir}" for r in runs]

    failing = tmp_path / "failing-wandb"
    failing.write_text("#!/bin/sh\nexit 3\n")
    failing.chmod(0o755)
    assert wo.main([str(resumed_dir), "--sync", "--wandb-exe", str(failing)]) == 3
    assert "stopping" in capsys.readouterr().out


def test_module_entry_point(resumed_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "comlrl.wandb_offline", str(resumed_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.stdout.count(f"id={RUN_ID}") == 2


def test_segments_sorted_by_dir_timestamp(resumed_dir: Path, tmp_path: Path) -> None:
    # Copy the segments under swapped names: order follows the directory
    # timestamp, not the order the filesystem lists them in.
    runs = wo.find_offline_runs(resumed_dir)
    root = tmp_path / "wandb"
    for stamp, run in zip(("20990101_000001", "20990101_000000"), runs):
        shutil.copytree(run.run_dir, root / f"offline-run-{stamp}-{RUN_ID}")
    got = wo.find_offline_runs(tmp_path)
    assert [r.run_dir.name[12:27] for r in got] == ["20990101_000000", "20990101_000001"]
    assert [r.steps[0] for r in got] == [3, 1]
