"""The run-summary cache behind ``status``: a hit is exactly what ``summarize`` would say, and every
change ``summarize`` could see invalidates it (or the entry is never cached)."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.rundir.summary import summarize
from orchestrator.rundir.summary_cache import SummaryCache
from tests.helpers.run_dirs import make_checkpoint, train_event, write_metrics

_AGES = itertools.count(1)


def age(run_dir: Path) -> None:
    """Back-date everything (as files an hour old): fresh mtimes are deliberately not cached.
    Each call picks another time: a real folder's mtime never goes back to an earlier value."""
    old = time.time() - 3600 + next(_AGES)
    for root, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (old, old))
    os.utime(run_dir, (old, old))


def make_run(run_dir: Path) -> None:
    # No max_steps in the events: summarize takes it from job.json (a script that does not log it).
    write_metrics(run_dir, [train_event(s, 1000.0 + s, max_steps=None) for s in range(1, 41)])
    (run_dir / "job.json").write_text(json.dumps({"nodes": 1, "procs_per_node": 4, "max_steps": 100}))
    make_checkpoint(run_dir, 20, {"model.distcp": 64})
    make_checkpoint(run_dir, 40, {"model.distcp": 64, "optim/0.distcp": 32})
    (run_dir / "logs" / "attempt_0").mkdir(parents=True)
    age(run_dir)


def cached_twice(cache_file: Path, run_dir: Path) -> tuple[object, object]:
    """(first answer, answer from a new process's view of the saved cache)."""
    first = SummaryCache(cache_file)
    a = first.summarize(run_dir)
    first.save()
    return a, SummaryCache(cache_file).summarize(run_dir)


def test_hit_equals_fresh_summary(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run)
    cache_file = tmp_path / "cache.json"
    a, b = cached_twice(cache_file, run)
    assert a == b == summarize(run)
    assert str(run) in json.loads(cache_file.read_text())["entries"]
    assert oct(cache_file.stat().st_mode & 0o777) == "0o600"


def _append_step(run: Path) -> None:
    write_metrics(run, [train_event(41, 1041.0)])


def _new_checkpoint(run: Path) -> None:
    make_checkpoint(run, 60, {"model.distcp": 8})


def _truncate_checkpoint_file(run: Path) -> None:
    with open(run / "checkpoints" / "step_00000040" / "optim" / "0.distcp", "r+b") as fh:
        fh.truncate(1)


def _marker_lands_in_newer_folder(run: Path) -> None:
    """Special-cased in the test: the marker-less folder must be cached first."""


def _new_attempt(run: Path) -> None:
    (run / "logs" / "attempt_1").mkdir()


def _job_json_rewritten(run: Path) -> None:
    (run / "job.json").write_text(json.dumps({"nodes": 2, "procs_per_node": 4, "max_steps": 500}))


def _metrics_removed(run: Path) -> None:
    (run / "metrics.jsonl").unlink()


@pytest.mark.parametrize(
    "change",
    [
        _append_step,
        _new_checkpoint,
        _truncate_checkpoint_file,
        _marker_lands_in_newer_folder,
        _new_attempt,
        _job_json_rewritten,
        _metrics_removed,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_changes_are_seen(tmp_path: Path, change: Callable[[Path], None]) -> None:
    run = tmp_path / "run"
    make_run(run)
    cache_file = tmp_path / "cache.json"
    before, _ = cached_twice(cache_file, run)
    if change is _marker_lands_in_newer_folder:
        # First cache the run with the new, marker-less folder in it, then let the marker land.
        make_checkpoint(run, 60, {"model.distcp": 8}, marker=False)
        age(run)
        cached_twice(cache_file, run)
        (run / "checkpoints" / "step_00000060" / "COMPLETE.json").write_text(
            json.dumps({"step": 60, "files": {"model.distcp": 8}})
        )
    else:
        change(run)
    fresh = summarize(run)
    assert fresh != before, "the change must matter to summarize, or this test proves nothing"
    assert SummaryCache(cache_file).summarize(run) == fresh


def test_recent_files_are_not_cached(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run)
    _append_step(run)  # metrics.jsonl modified just now: a live run
    cache_file = tmp_path / "cache.json"
    cached_twice(cache_file, run)
    assert not cache_file.exists() or str(run) not in json.loads(cache_file.read_text())["entries"]


@pytest.mark.parametrize("content", ["", "{", "[]", '{"version": 3, "entries": {"x": 1}}', "\0\0"])
def test_bad_cache_file_is_ignored(tmp_path: Path, content: str) -> None:
    run = tmp_path / "run"
    make_run(run)
    cache_file = tmp_path / "cache.json"
    cache_file.write_text(content)
    assert SummaryCache(cache_file).summarize(run) == summarize(run)
    entries = {str(run): ["x", [[], None, []], [[1], None]]}  # matching nothing / malformed
    cache_file.write_text(json.dumps({"version": 3, "entries": entries}))
    assert SummaryCache(cache_file).summarize(run) == summarize(run)


def test_resume_scan_progress_carries_over_between_processes(tmp_path: Path) -> None:
    """A live run is re-summarised on every call; its whole-file resume count must not mean reading
    the whole metrics.jsonl every time: the scan position is kept in the cache file."""
    from orchestrator.rundir import summary as R

    R._resume_cache.clear()  # this process's earlier tests
    R._resume_touched.clear()
    run = tmp_path / "run"
    make_run(run)
    write_metrics(run, [{"event": "resume", "step": 20, "checkpoint": "x", "time": 1.0}])  # live
    cache_file = tmp_path / "cache.json"
    first = SummaryCache(cache_file)
    assert first.summarize(run).resumes == 1
    first.save()
    size = (run / "metrics.jsonl").stat().st_size
    saved = json.loads(cache_file.read_text())["resumes"]
    assert [row[2:] for row in saved] == [[size, 1]]
    R._resume_cache.clear()  # a new process
    R._resume_touched.clear()
    write_metrics(
        run, [train_event(41, 1041.0), {"event": "resume", "step": 40, "checkpoint": "y", "time": 2.0}]
    )
    again = SummaryCache(cache_file)
    assert R._resume_cache  # seeded from the file: only the appended bytes get scanned
    assert again.summarize(run) == summarize(run)
    assert again.summarize(run).resumes == 2


def test_a_checkpoint_marked_corrupt_after_caching_is_seen(tmp_path: Path) -> None:
    """A restore that finds the newest checkpoint's bytes bad writes CORRUPT.json inside its folder:
    no folder or marker stat the cache keys on shows that, yet the next status must not call it the
    last checkpoint, and must say it was skipped."""
    from orchestrator.contract.checkpoints import mark_checkpoint_corrupt

    run = tmp_path / "run"
    make_run(run)
    cache_file = tmp_path / "cache.json"
    first, again = cached_twice(cache_file, run)
    assert first.checkpoint is not None and first.checkpoint.step == 40 and again == first
    mark_checkpoint_corrupt(run / "checkpoints" / "step_00000040", "file model.distcp: sha256 differs")
    later = SummaryCache(cache_file).summarize(run)
    assert later.checkpoint is not None and later.checkpoint.step == 20
    assert later.corrupt_checkpoints == [40]
    assert later == summarize(run)
