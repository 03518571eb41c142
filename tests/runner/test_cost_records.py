"""``orchestrator cost`` on what a run directory really holds (issue 41, item 5): records of any JSON
shape never make a traceback (the command) or a 500 (the dashboard's bill), and the bill says what it
could not read; a real local job is billed from its own records, in CPU-hours at the profile's
``price_per_cpu_hour``, and ``status --cost`` shows it; restarts inside an allocation
(``restarts.jsonl``) put each attempt on its own part of the allocation."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from orchestrator.contract.job_states import JobState
from orchestrator.registry.store import Registry
from orchestrator.runner.cost import gather
from orchestrator.runner.cost_model import LABELS, AttemptEvidence, account_run, bill
from orchestrator.schedulers.query import Allocation
from tests.helpers.cli import REPO, job_and_run_dir, run_cli, user_profile_dir
from tests.helpers.preconditions import require_modules

T0 = 1_800_000_000.0
TOKEN = "t0ken-for-the-cost-tests-of-issue-41"

#: ``hang/attempt_0/hang.json`` as the watchdog never writes it: every shape a field (or the file) can
#: take: a wrong type in a heartbeat, a list, null, a string, a number, NaN, not JSON at all.
HANG_REPORTS = {
    "heartbeat_time_string": '{"heartbeats": {"0": {"time": "x"}}}',
    "heartbeat_time_null": '{"heartbeats": {"0": {"time": null}}}',
    "heartbeat_time_list": '{"heartbeats": {"0": {"time": [1, 2]}}}',
    "heartbeat_time_bool": '{"heartbeats": {"0": {"time": true}}}',
    "heartbeat_time_nan": '{"heartbeats": {"0": {"time": NaN}}}',
    "heartbeat_list": '{"heartbeats": {"0": [1, 2]}}',
    "heartbeat_null": '{"heartbeats": {"0": null}}',
    "heartbeat_string": '{"heartbeats": {"0": "x"}}',
    "heartbeats_list": '{"heartbeats": [{"time": 1}, 2]}',
    "heartbeats_string": '{"heartbeats": "x"}',
    "heartbeats_null": '{"heartbeats": null}',
    "heartbeats_number": '{"heartbeats": 3}',
    "time_string": '{"time": "x", "stalled_s": 5}',
    "stalled_null": '{"time": 1800000040, "stalled_s": null}',
    "stalled_list": '{"time": 1800000040, "stalled_s": [1], "collection_s": "x"}',
    "report_list": "[1, 2]",
    "report_null": "null",
    "report_string": '"x"',
    "report_number": "3",
    "report_not_json": "{not json",
}
#: The other records a bill reads, in shapes their writers never use.
OTHER_RECORDS: dict[str, dict[str, str]] = {
    "preflight_seconds_string": {"preflight/attempt_0/preflight.json": '{"seconds": "x"}'},
    "preflight_list": {"preflight/attempt_0/preflight.json": "[3]"},
    "start_step_string": {"logs/attempt_0/start.json": '{"step": "x"}'},
    "start_null": {"logs/attempt_0/start.json": "null"},
    "restarts_junk": {"restarts.jsonl": '[1]\n{"job_id": null, "attempt": "1", "time": "x"}\nnull\n'},
    "profile_price_string": {"job.json": '{"profile": {"gpus_per_node": 0, "price_per_cpu_hour": "x"}}'},
    "metrics_junk": {
        "metrics.jsonl": '[1]\nnull\n{"event": "train", "step": "x", "time": 1800000012}\n'
        '{"event": "train", "step": 9, "time": NaN}\n{"event": "train", "step": 9, "time": 1800000012, '
        '"step_time_s": "x"}\n{"event": "eval", "step": [], "time": 1}\n'
    },
}
CASES = {**{k: {"hang/attempt_0/hang.json": v} for k, v in HANG_REPORTS.items()}, **OTHER_RECORDS}


def _local_job(registry: Registry, runs: Path, job_id: str, files: dict[str, str]) -> None:
    """A finished local job of 40 s on 2 CPUs with 4 steps, then ``files`` written over its records."""
    run = runs / job_id
    attempt = run / "logs" / "attempt_0"
    attempt.mkdir(parents=True)
    held = {
        "job_id": job_id,
        "node": 0,
        "pid": 1,
        "start": T0,
        "end": T0 + 40,
        "procs": 2,
        "cpus": 2,
        "gpus": 0,
    }
    (attempt / "node_0.held.json").write_text(json.dumps(held))
    (attempt / "start.json").write_text(json.dumps({"step": 0, "checkpoint": None, "hook": "train"}))
    steps = [{"event": "train", "step": s, "step_time_s": 2.0, "time": T0 + 10 + 2 * s} for s in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))
    (run / "job.json").write_text(json.dumps({"profile": {"gpus_per_node": 0, "price_per_cpu_hour": 2.0}}))
    for rel, text in files.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(run / rel, "a" if rel == "metrics.jsonl" else "w") as fh:
            fh.write(text)
    registry.add_job(
        job_id=job_id,
        name="n",
        profile="local",
        scheduler="local",
        strategy="ddp",
        nodes=1,
        procs_per_node=2,
        command=["train.py"],
        run_dir=run,
        submitted_at=T0 - 1,
        state=JobState.COMPLETED,
    )


@pytest.fixture
def bad_records(tmp_path: Path, orch_env: dict[str, str]) -> Path:
    """One local job per case of :data:`CASES`, in the registry the CLI reads (its id: the case)."""
    home = Path(orch_env["ORCHESTRATOR_HOME"])
    with Registry.open(home) as registry:
        for case, files in CASES.items():
            _local_job(registry, tmp_path / "runs", case, files)
    return home


def _says(data: dict[str, Any], case: str) -> bool:
    """The bill's notes name the file of ``case`` it could not read."""
    names = {Path(rel).name for rel in CASES[case]}
    return any(n.startswith("unreadable record") and any(x in n for x in names) for n in data["notes"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_cost_of_a_run_with_unreadable_records_is_a_bill_not_a_traceback(
    bad_records: Path, orch_env: dict[str, str], case: str
) -> None:
    res = run_cli(["cost", case, "--json"], orch_env, timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    data = json.loads(res.stdout)
    assert data["unit"] == "cpu" and data["allocated_hours"] == pytest.approx(40 * 2 / 3600, abs=1e-5)
    assert _says(data, case), data["notes"]
    if case != "metrics_junk":
        assert data["attempts"][0]["steps"] == 4
    table = run_cli(["cost", case], orch_env, timeout=60)
    assert table.returncode == 0 and "Traceback" not in table.stderr, table.stdout + table.stderr
    assert "CPU-hours allocated" in table.stdout


def test_the_dashboards_bill_of_unreadable_records_is_no_500(
    bad_records: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every case through the dashboard's bill endpoint, on loopback: 200 and the same notes."""
    require_modules("plotly")
    from orchestrator.ui.server import Dashboard
    from orchestrator.ui.views import Views

    server = Dashboard("127.0.0.1", 0, Views(bad_records), TOKEN, 1.0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    answers: dict[str, tuple[int, Any]] = {}
    try:
        for case in sorted(CASES):
            address = f"http://127.0.0.1:{server.server_address[1]}/api/job/{case}/cost"
            request = urllib.request.Request(address, headers={"Authorization": f"Bearer {TOKEN}"})
            try:
                with urllib.request.urlopen(request, timeout=30) as answer:
                    answers[case] = (answer.status, json.load(answer))
            except urllib.error.HTTPError as exc:
                answers[case] = (exc.code, exc.read().decode(errors="replace"))
        assert {c: a for c, a in answers.items() if a[0] != 200} == {}
        for case, (_, data) in answers.items():
            assert data["unit"] == "cpu" and _says(data, case), (case, data["notes"])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.slow
@pytest.mark.usefixtures("reap_local_jobs")
def test_a_local_job_is_billed_in_cpu_hours_from_its_own_wall_clock(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    """A real 2-node local job: its allocation is its processes' own span (between the node entry's
    own "after N s" and the test's clock around submit and wait) on 2 CPUs, priced at the profile's
    ``price_per_cpu_hour``; ``cost`` and ``status --cost`` say CPU-hours and the money."""
    env = {
        **orch_env,
        "ORCHESTRATOR_PROFILES": str(user_profile_dir(tmp_path, "local", price_per_cpu_hour=900.0)),
    }
    began = time.time()
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", "2", "--procs-per-node", "1", "--wait", "--poll", "0.3",
         "--", str(REPO / "train" / "train.py"), "--preset", "tiny", "--data", "synthetic", "--max-steps", "12"],
        env,
        timeout=240,
    )  # fmt: skip
    ended = time.time()
    assert res.returncode == 0 and "COMPLETED" in res.stdout, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    bill = run_cli(["cost", job_id, "--json"], env, timeout=60)
    assert bill.returncode == 0, bill.stdout + bill.stderr
    data = json.loads(bill.stdout)
    (attempt,) = data["attempts"]
    assert data["unit"] == "cpu" and (attempt["resources"], attempt["unit"]) == (2, "cpu")
    # The node entry's own figure (its launch to its exit) is inside the processes' span, which is
    # inside the test's clock (the CLI's start-up and the polling are not the job's).
    nodes = [
        float(line.rsplit("after ", 1)[1].split()[0])
        for log in sorted((run_dir / "logs" / "attempt_0").glob("node_*.log"))
        for line in log.read_text().splitlines()
        if " exit=" in line and " after " in line
    ]
    assert len(nodes) == 2, nodes
    allocated = attempt["allocated_s"]
    assert max(nodes) - 0.5 <= allocated <= ended - began, (nodes, allocated, ended - began)
    assert allocated >= (ended - began) - max(6.0, 0.25 * (ended - began)), (allocated, ended - began)
    assert data["allocated_hours"] == pytest.approx(allocated * 2 / 3600, rel=1e-3)
    assert data["price_per_hour"] == 900.0
    assert data["money"]["allocated"] == pytest.approx(data["allocated_hours"] * 900.0, abs=0.01)
    assert attempt["steps"] == 12 and data["hours"]["productive"] > 0
    assert data["unbilled_s"]["queue_wait"] < 5.0
    table = run_cli(["cost", job_id], env, timeout=60)
    assert f"job {job_id}: {data['allocated_hours']:.4f} CPU-hours allocated" in table.stdout, table.stdout
    status = run_cli(["status", job_id, "--cost"], env, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"job {job_id}: {data['allocated_hours']:.4f} CPU-hours allocated" in status.stdout, status.stdout
    assert f"{data['money']['allocated']:.2f} at 900/hour" in status.stdout, status.stdout
    as_json = json.loads(run_cli(["status", job_id, "--cost", "--json"], env, timeout=60).stdout)
    assert as_json["jobs"][0]["cost"]["allocated_hours"] == pytest.approx(data["allocated_hours"])


def _restarted_run(run: Path, hang_at: float | None = None) -> list[AttemptEvidence]:
    """One allocation (0..100 s, 2 GPUs) in which the batch step restarted training: attempt 0 starts
    up to 10 s, trains steps 1-6 (5 s each) and fails at 40; the restart is recorded at 45; attempt 1
    restored step 4 and trains steps 5-10 from 55 to 85; the rest is shutdown."""
    run.mkdir()
    lines = [{"event": "train", "step": s, "step_time_s": 5.0, "time": T0 + 10 + 5 * s} for s in range(1, 7)]
    lines += [
        {"event": "train", "step": s, "step_time_s": 5.0, "time": T0 + 55 + 5 * (s - 4)} for s in range(5, 11)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for attempt, at, start in ((0, T0 + 1, 0), (1, T0 + 46, 4)):
        folder = run / "logs" / f"attempt_{attempt}"
        folder.mkdir(parents=True)
        (folder / "start.json").write_text(json.dumps({"step": start, "checkpoint": None, "hook": "train"}))
        os.utime(folder / "start.json", (at, at))
    record = {
        "job_id": "7",
        "failed_attempt": 0,
        "attempt": 1,
        "cause": "rank 1 died",
        "step": 4,
        "time": T0 + 45,
    }
    (run / "restarts.jsonl").write_text(json.dumps(record) + "\n")
    if hang_at is not None:
        (run / "hang" / "attempt_0").mkdir(parents=True)
        (run / "hang" / "attempt_0" / "hang.json").write_text(
            json.dumps({"heartbeats": {"0": {"time": hang_at}}})
        )
    return gather(run, [Allocation("7", T0 - 3, T0, T0 + 100, 2, 8, 1, "COMPLETED")])


def test_restarts_jsonl_places_each_attempt_on_its_part_of_the_allocation(tmp_path: Path) -> None:
    """Restarts inside the allocation (restarts.jsonl): each attempt gets its own part of the one
    allocation, the fault to training again is ``restart``, the steps trained twice are lost work, and
    the parts add up to the allocation."""
    first, second = _restarted_run(tmp_path / "run")
    assert (first.attempt, second.attempt) == (0, 1)
    assert [s.step for s in first.steps] == [1, 2, 3, 4, 5, 6] and [s.step for s in second.steps] == list(
        range(5, 11)
    )
    a, b = account_run([second, first], now=T0 + 1000)
    assert (a.start, a.end, b.start, b.end) == (T0, T0 + 45, T0 + 45, T0 + 100)
    assert a.seconds["startup"] == pytest.approx(10.0)
    assert a.seconds["productive"] == pytest.approx(20.0) and a.lost_steps == 2
    assert a.seconds["lost_work"] == pytest.approx(10.0)
    assert a.seconds["restart"] == pytest.approx(5.0) and a.seconds["shutdown"] == 0
    assert b.seconds["restart"] == pytest.approx(10.0) and b.seconds["startup"] == 0
    assert b.seconds["productive"] == pytest.approx(30.0)
    assert b.seconds["shutdown"] == pytest.approx(15.0)
    assert a.allocated_s + b.allocated_s == pytest.approx(100.0)
    assert a.waited == {"queue_wait": pytest.approx(3.0)} and b.waited == {}
    cost = bill([a, b])
    assert cost.hours["restart"] == pytest.approx(15.0 * 2 / 3600)
    assert cost.allocated_hours == pytest.approx(100.0 * 2 / 3600)
    assert LABELS["restart"].startswith("restart")


def test_a_hung_attempt_and_its_restart_read_from_the_run_directory(tmp_path: Path) -> None:
    """The watchdog ended attempt 0 (its last progress 42 s, 2 s into step 7): the hang runs to the
    restart's record, the next attempt's start-up is the restart."""
    first, second = _restarted_run(tmp_path / "run", hang_at=T0 + 42)
    a, b = account_run([first, second], now=T0 + 1000)
    assert a.seconds["hang"] == pytest.approx(3.0) and a.seconds["restart"] == 0
    assert a.seconds["lost_work"] == pytest.approx(12.0)
    assert b.seconds["restart"] == pytest.approx(10.0)
    assert sum(a.seconds.values()) + sum(b.seconds.values()) == pytest.approx(100.0)
