"""Notifications (a profile's ``notify:``): the profile key, the events a run directory says, each
claimed exactly once among concurrent claimers, the webhook and command channels against a real
local HTTP receiver, retries, and the secret URL kept out of every rendered or written file.

The real cluster's side (the batch step sends, preemption, a failed job, a receiver down):
tests/cluster/test_notify.py."""

from __future__ import annotations

import json
import multiprocessing
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from orchestrator.config.plan import build_plan, merge_options
from orchestrator.config.profile.load import parse_profile
from orchestrator.config.render import render_sbatch
from orchestrator.contract.errors import UserError
from orchestrator.contract.job_states import JobState
from orchestrator.contract.run_dir import (
    attempt_dir,
    hang_dir,
    plan_file,
    write_json_atomic,
    write_plan,
)
from orchestrator.notify import events as notify
from orchestrator.notify import outbox
from orchestrator.notify.owner import RunNotifier
from tests.helpers.cli import REPO, poll
from tests.helpers.webhook import SECRET, Receiver

BASE = yaml.safe_load((REPO / "cluster_profiles" / "slurm_test.yaml").read_text())


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _run_dir(tmp_path: Path, notify_block: dict) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_plan(run_dir, 0, {"job_name": "lm", "profile": {**BASE, "notify": notify_block}})
    notify.prepare(run_dir, {"profile": {"notify": notify_block}})
    return run_dir


# ---------------------------------------------------------------------------- the profile key
def test_a_valid_notify_block_is_read() -> None:
    text = yaml.safe_dump({**BASE, "notify": {"webhook_env": "SLACK_WEBHOOK", "command": "mail -s x me"}})
    profile = parse_profile(text, "/p/n.yaml")
    assert profile.notify.webhook_env == "SLACK_WEBHOOK" and profile.notify.timeout_s == 60
    assert profile.notify.command == "mail -s x me" and profile.notify.webhook_file is None


@pytest.mark.parametrize(
    "block, key, expected",
    [
        ({"webhook_env": "SLACK WEBHOOK"}, "notify.webhook_env", "like SLACK_WEBHOOK"),
        ({"webhook_file": "https://hooks.slack.com/x"}, "notify.webhook_file", "not a URL"),
        ({"command": "a\nb"}, "notify.command", "single-line"),
        ({"webhook_file": "hook.url"}, "notify.webhook_file", "from / or ~/"),
        ({"timeout_s": 0}, "notify.timeout_s", "1"),
        ({"webhook": "x"}, "notify.webhook", ""),
    ],
)
def test_bad_notify_values_are_one_line_naming_file_and_key(block: dict, key: str, expected: str) -> None:
    with pytest.raises(UserError) as err:
        parse_profile(yaml.safe_dump({**BASE, "notify": block}), "/p/n.yaml")
    message = str(err.value)
    assert "\n" not in message and message.startswith("/p/n.yaml: ") and key in message, message
    assert expected in message, message


def test_the_webhook_url_is_never_rendered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hook = tmp_path / "hook"
    hook.write_text(f"https://hooks.example{SECRET}\n")
    monkeypatch.setenv("SLACK_WEBHOOK", f"https://hooks.example{SECRET}")
    text = yaml.safe_dump({**BASE, "notify": {"webhook_env": "SLACK_WEBHOOK", "webhook_file": str(hook)}})
    profile = parse_profile(text, "n.yaml")
    plan = build_plan(
        "t", profile, merge_options(profile), str(REPO / "train" / "train.py"), nodes=2, procs_per_node=1
    )
    sbatch = render_sbatch(plan, str(tmp_path / "run"), str(tmp_path / "run/submitit"), sys.executable)
    assert SECRET not in sbatch and SECRET not in json.dumps(plan.to_json())


# ---------------------------------------------------------------------------- the events
def test_events_derived_from_the_run_directory(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, {"command": "true"})
    for a in (0, 1, 2):
        attempt_dir(run_dir, a).mkdir(parents=True)
    write_json_atomic(
        attempt_dir(run_dir, 1) / "start.json", {"step": 7, "checkpoint": "c/step_7", "hook": "t"}
    )
    write_json_atomic(plan_file(run_dir, 2), {"job_name": "lm"})  # a new submission began at attempt 2
    hang_dir(run_dir, 2).mkdir(parents=True)
    hang = {"reason": "hang: rank 3 on node n2 differs: in recv", "culprit_rank": 3}
    write_json_atomic(hang_dir(run_dir, 2) / "hang.json", hang)
    events = {e.key: e for e in notify.run_dir_events(run_dir, "42")}
    assert list(events) == [
        "started",
        "requeued.attempt_1",
        "resumed.attempt_1",
        "continued.attempt_2",
        "hang.attempt_2",
    ]
    assert (
        events["resumed.attempt_1"].details["step"] == 7 and "from step 7" in events["resumed.attempt_1"].text
    )
    assert (
        "rank 3 on node n2" in events["hang.attempt_2"].text and events["hang.attempt_2"].details["rank"] == 3
    )
    failed = notify.end_event(run_dir, "42", "FAILED", "node 0 rank 1 failed: ValueError: boom")
    assert failed is not None and failed.kind == "failed" and "ValueError: boom" in failed.text
    assert notify.end_event(run_dir, "42", "COMPLETED", None).kind == "completed"  # type: ignore[union-attr]
    assert notify.end_event(run_dir, "42", "CANCELLED", None) is None
    assert notify.end_event(run_dir, "42", "RUNNING", None) is None
    # a first attempt that restored nothing is no resume
    write_json_atomic(attempt_dir(run_dir, 0) / "start.json", {"step": 0, "checkpoint": None, "hook": "t"})
    assert "resumed.attempt_0" not in {e.key for e in notify.run_dir_events(run_dir, "42")}


def _record(args: tuple[str, int]) -> bool:
    run_dir, i = args
    return outbox.record(
        Path(run_dir), "end.7", {"event": "completed", "key": "end.7", "text": f"recorder {i}"}
    )


def test_each_event_is_recorded_exactly_once_among_concurrent_processes(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, {"command": "true"})
    with multiprocessing.get_context("fork").Pool(8) as pool:
        won = pool.map(_record, [(str(run_dir), i) for i in range(64)])
    assert won.count(True) == 1
    [only] = outbox.recorded(run_dir)
    assert only.payload["text"] == f"recorder {won.index(True)}"


def _owner(run_dir: Path, job_id: str = "9", attempt: int = 0) -> RunNotifier:
    return RunNotifier(run_dir, job_id, attempt, print)


def _modes(folder: Path) -> set[str]:
    return {oct(p.stat().st_mode & 0o777) for p in folder.rglob("*")}


# ---------------------------------------------------------------------------- sending
def test_a_receiver_down_then_up_gets_every_event_once_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner records as things happen and its courier retries with backoff: nothing is lost
    while the receiver is down, nothing overtakes, nothing comes twice; the log never holds the URL."""
    down = Receiver()
    port, url = down.port, down.url
    down.close()  # connection refused until it comes back on the same port
    monkeypatch.setenv("NOTIFY_TEST_HOOK", url)
    run_dir = _run_dir(tmp_path, {"webhook_env": "NOTIFY_TEST_HOOK", "timeout_s": 60})
    attempt_dir(run_dir, 0).mkdir(parents=True)
    owner = _owner(run_dir)
    owner.attempt_events()
    write_json_atomic(attempt_dir(run_dir, 0) / "start.json", {"step": 0, "checkpoint": None, "hook": "t"})
    owner.end("FAILED", "node 0 rank 0 failed: ValueError: boom")
    log = run_dir / "notify" / "notify.log"
    poll(lambda: log.exists() and "started: webhook try 2 failed" in log.read_text(), 30, "two failed tries")
    up = Receiver(port=port)
    try:
        owner.close()
        assert up.texts() == ["lm: job 9 started", "lm: job 9 FAILED: node 0 rank 0 failed: ValueError: boom"]
    finally:
        up.close()
    text = log.read_text()
    assert (
        "Connection refused" in text
        and "started: webhook sent (" in text
        and "end.9: webhook sent (1 try)" in text
    )
    everything = b"".join(p.read_bytes() for p in run_dir.rglob("*") if p.is_file())
    assert SECRET.encode() not in everything
    assert _modes(run_dir / "notify") <= {"0o600", "0o700"}, _modes(run_dir / "notify")


def test_what_an_owner_left_unsent_the_next_owner_sends_first(tmp_path: Path) -> None:
    down = Receiver()
    port = down.port
    (tmp_path / "hook").write_text(down.url + "\n")
    down.close()
    run_dir = _run_dir(tmp_path, {"webhook_file": str(tmp_path / "hook"), "timeout_s": 60})
    attempt_dir(run_dir, 0).mkdir(parents=True)
    first = _owner(run_dir)
    first.attempt_events()
    first.close(most_s=1.0)  # the attempt ends (a requeue) with "started" unsent
    assert [r.key for r in outbox.pending(run_dir, ["webhook"])] == ["started"]
    assert "left unsent at this owner's end" in (run_dir / "notify" / "notify.log").read_text()
    up = Receiver(port=port)
    try:
        attempt_dir(run_dir, 1).mkdir(parents=True)
        second = _owner(run_dir, attempt=1)
        second.attempt_events()
        second.end("COMPLETED", None)
        second.close()
        assert up.texts() == ["lm: job 9 started", "lm: job 9 requeued (attempt 1)", "lm: job 9 completed"]
    finally:
        up.close()


def test_two_owners_draining_at_once_send_each_event_once(tmp_path: Path) -> None:
    """A local job's node 0 still waits for a receiver while ``resume``'s new job has started."""
    r = Receiver(fail_first=3)
    try:
        (tmp_path / "hook").write_text(r.url)
        run_dir = _run_dir(tmp_path, {"webhook_file": str(tmp_path / "hook")})
        attempt_dir(run_dir, 0).mkdir(parents=True)
        owners = [_owner(run_dir), _owner(run_dir)]
        for o in owners:
            o.end("COMPLETED", None)
        for o in owners:
            o.close()
        assert r.texts() == ["lm: job 9 started", "lm: job 9 completed"]
    finally:
        r.close()


@pytest.mark.parametrize(
    "url, why",
    [
        (f"https://hooks.slack.com/x {SECRET}", "holds a space"),
        (f"https://hooks.slack.com{SECRET}\tx", "holds a space"),
        (f"file://{SECRET}", "not http(s)"),
        (f"ftp://hooks.example{SECRET}", "not http(s)"),
        (f"https://{SECRET}", "names no host"),
        ("hooks.slack.com/services/T000/B000/s3cr3t", "not http(s)"),
    ],
)
def test_a_url_that_is_not_http_is_never_sent_and_never_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, why: str
) -> None:
    monkeypatch.setenv("NOTIFY_TEST_HOOK", url)
    run_dir = _run_dir(tmp_path, {"webhook_env": "NOTIFY_TEST_HOOK"})
    attempt_dir(run_dir, 0).mkdir(parents=True)
    owner = _owner(run_dir)
    owner.attempt_events()
    owner.close(most_s=1.0)
    log = (run_dir / "notify" / "notify.log").read_text()
    assert why in log and "sent (" not in log, log
    for part in ("s3cr3t", "hooks.slack.com", "hooks.example"):
        assert part not in log, log


def test_the_command_gets_the_event_on_stdin_and_in_its_environment(tmp_path: Path) -> None:
    out = tmp_path / "got"
    command = f'cat > {out}.json; printf %s "$ORCHESTRATOR_EVENT|$ORCHESTRATOR_EVENT_TEXT" > {out}.env'
    run_dir = _run_dir(tmp_path, {"command": command})
    attempt_dir(run_dir, 0).mkdir(parents=True)
    owner = _owner(run_dir, "5")
    owner.attempt_events()
    owner.close()
    assert json.loads(Path(f"{out}.json").read_text())["event"] == "started"
    assert Path(f"{out}.env").read_text() == "started|lm: job 5 started"
    assert "started: command sent (1 try)" in (run_dir / "notify" / "notify.log").read_text()


def test_a_preempted_job_is_sent_as_preempted_not_failed(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, {"command": "true"})
    end = notify.end_event(run_dir, "local-3", "PREEMPTED", None)
    assert end is not None and end.kind == "preempted", end
    assert "preempted" in end.text and "orchestrator resume local-3" in end.text and "FAILED" not in end.text


def test_a_finished_sweep_is_notified_once_naming_its_best_task(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from orchestrator.notify.login import notify_sweep

    out = tmp_path / "got.json"
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    task = _run_dir(sweep_dir, {"command": f"cat >> {out}"})
    rows = [
        SimpleNamespace(run_dir=str(task), job_id=f"7_{i}", loss=loss) for i, loss in enumerate((2.5, 1.25))
    ]
    status = SimpleNamespace(
        sweep_id="7", rows=rows, params=[{"lr": "0.1"}, {"lr": "0.01"}], tasks=[0, 1], metric="loss", best=1
    )
    notify_sweep(status, None, sweep_dir)  # a task still running: nothing yet
    assert not (sweep_dir / "notify").exists()
    for _ in range(2):
        notify_sweep(status, JobState.COMPLETED, sweep_dir)
    poll(lambda: out.exists() and out.read_text().endswith("}"), 30, "the sweep's notification")
    sent = json.loads(out.read_text())
    assert sent["event"] == "sweep_finished" and sent["best"] == "task 1 (lr=0.01), job 7_1, loss 1.25", sent
    assert sent["text"] == "sweep 7 finished COMPLETED; best task: task 1 (lr=0.01), job 7_1, loss 1.25"


def test_the_batch_steps_end_event_follows_the_runs_fate(tmp_path: Path) -> None:
    """Completed, failed with the failure report's reason, or nothing: training asked for a requeue,
    or the run went on as another job (its events come from that job)."""
    from orchestrator.contract.run_dir import write_exit_status
    from orchestrator.schedulers.slurm.step_notify import StepNotifier

    out = tmp_path / "got.jsonl"
    run_dir = _run_dir(tmp_path, {"command": f"cat >> {out}; echo >> {out}"})
    attempt_dir(run_dir, 0).mkdir(parents=True)
    (run_dir / "job_id").write_text("11")

    def sent() -> list[str]:
        return [json.loads(x)["key"] for x in out.read_text().splitlines() if x] if out.exists() else []

    step = StepNotifier(run_dir, "11", 0, print)
    step.attempt_events()
    write_exit_status(run_dir, 75, "stop signal")  # checkpointed on a stop signal: a requeue comes
    step.ended(1, step_started=0.0)
    step.flush()
    assert sent() == ["started"] and step.continues
    (run_dir / "job_id").write_text("12")  # handed over to job 12
    handed = StepNotifier(run_dir, "11", 0, print)
    handed.ended(1, step_started=1e12)
    handed.flush()
    assert sent() == ["started"]
    (run_dir / "job_id").write_text("11")
    last = StepNotifier(run_dir, "11", 0, print)
    last.ended(0, step_started=1e12)
    last.flush()
    assert sent() == ["started", "end.11"]
    assert json.loads(out.read_text().splitlines()[-1])["event"] == "completed"
