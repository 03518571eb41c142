"""The bill's arithmetic (``orchestrator cost``), with hand-built records: every category, the sum
rule, lost work across attempts, a sweep's rollup, Slurm's accounting lines, and the records a run
directory holds read back into evidence."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrator.runner.cost import gather, read_metrics
from orchestrator.runner.cost_model import (
    CATEGORIES,
    LABELS,
    AttemptEvidence,
    EvalRecord,
    StepRecord,
    account_attempt,
    account_run,
    bill,
    lost_steps,
)
from orchestrator.schedulers.query import Allocation
from orchestrator.schedulers.slurm.accounting import parse_accounting, parse_tres

T0 = 1_800_000_000.0


def alloc(
    start: float, end: float | None, gpus: int = 2, job: str = "7", submit: float | None = None
) -> Allocation:
    return Allocation(job, submit, T0 + start, None if end is None else T0 + end, gpus, 8, 1, "COMPLETED")


def steps(
    first: int, last: int, start: float, seconds: float = 5.0, gaps: dict[int, float] | None = None
) -> tuple[StepRecord, ...]:
    """Steps ``first..last`` of ``seconds`` each from ``start`` (relative), ``gaps[s]``: idle after step s."""
    out, t = [], start
    for s in range(first, last + 1):
        t += seconds
        out.append(StepRecord(s, T0 + t, seconds))
        t += (gaps or {}).get(s, 0.0)
    return tuple(out)


def test_every_category_of_one_allocation_and_the_sum() -> None:
    # 0..100 s on 2 GPUs: preflight 3 s, start-up to 10 s, steps 1-10 of 5 s with 4 s after step 5
    # (a checkpoint) and 2 s after step 8 (an evaluation), last step ends at 56, the rest shutdown.
    ev = AttemptEvidence(
        alloc(0, 100),
        attempt=0,
        steps=steps(1, 10, 10.0, gaps={5: 4.0, 8: 2.0}),
        evals=(EvalRecord(8, T0 + 10 + 40 + 4 + 2),),
        start_step=0,
        preflight_s=3.0,
    )
    cost = account_attempt(ev, set(), now=T0 + 1000)
    s = cost.seconds
    assert s["preflight"] == pytest.approx(3.0)
    assert s["startup"] == pytest.approx(7.0)
    assert s["productive"] == pytest.approx(50.0)
    assert s["checkpoint"] == pytest.approx(4.0)
    assert s["evaluation"] == pytest.approx(2.0)
    assert s["shutdown"] == pytest.approx(100 - 66.0)
    assert s["hang"] == s["lost_work"] == 0
    assert s["unaccounted"] == pytest.approx(0.0, abs=1e-9)
    assert cost.allocated_s == pytest.approx(100.0)
    assert cost.hours()["productive"] == pytest.approx(50 * 2 / 3600)


def test_a_final_evaluation_is_evaluation_not_shutdown() -> None:
    ev = AttemptEvidence(alloc(0, 60), steps=steps(1, 4, 0.0), evals=(EvalRecord(4, T0 + 20 + 15),))
    s = account_attempt(ev, set(), now=T0 + 100).seconds
    assert s["evaluation"] == pytest.approx(15.0)
    assert s["checkpoint"] == 0
    assert s["shutdown"] == pytest.approx(25.0)


def test_lost_work_is_what_a_later_attempt_trained_again() -> None:
    first = AttemptEvidence(alloc(0, 80), attempt=0, steps=steps(1, 10, 10.0), start_step=0)
    # Attempt 1 restored step 6: steps 7-10 of attempt 0 were trained twice.
    second = AttemptEvidence(alloc(200, 260), attempt=1, steps=steps(7, 12, 210.0), start_step=6)
    assert lost_steps([first, second]) == [{7, 8, 9, 10}, set()]
    costs = account_run([second, first], now=T0 + 1000)  # any order in, time order out
    assert [c.attempt for c in costs] == [0, 1]
    assert costs[0].seconds["lost_work"] == pytest.approx(20.0)
    assert costs[0].seconds["productive"] == pytest.approx(30.0)
    assert costs[0].lost_steps == 4
    assert costs[1].seconds["productive"] == pytest.approx(30.0)
    assert costs[1].waited == {"requeue_gap": pytest.approx(120.0)}


def test_a_restart_from_step_zero_loses_everything_before_it() -> None:
    """No checkpoint hook: the next attempt trains from step 1 again (no start record: its first step)."""
    first = AttemptEvidence(alloc(0, 80), steps=steps(1, 10, 10.0))
    second = AttemptEvidence(alloc(100, 180), steps=steps(1, 10, 110.0))
    costs = account_run([first, second], now=T0 + 1000)
    assert costs[0].seconds["lost_work"] == pytest.approx(50.0)
    assert costs[0].seconds["productive"] == 0


def test_hang_runs_from_the_last_progress_to_the_end() -> None:
    # Steps 1-5 end at 35; a rank stopped in step 6 at 37 (its last progress); the watchdog ended the
    # allocation at 90: 2 s of the unfinished step are lost, 53 s are the hang.
    ev = AttemptEvidence(alloc(0, 90), steps=steps(1, 5, 10.0), hang_last_progress=T0 + 37.0)
    s = account_attempt(ev, set(), now=T0 + 1000).seconds
    assert s["hang"] == pytest.approx(53.0)
    assert s["lost_work"] == pytest.approx(2.0)
    assert s["shutdown"] == 0
    assert sum(s.values()) == pytest.approx(90.0)


def test_no_steps_is_unaccounted_and_said() -> None:
    ev = AttemptEvidence(alloc(0, 40), preflight_s=5.0)
    cost = account_attempt(ev, set(), now=T0 + 1000)
    assert cost.seconds["preflight"] == 5.0
    assert cost.seconds["unaccounted"] == pytest.approx(35.0)
    assert cost.notes


def test_a_running_allocation_ends_now_and_a_waiting_one_costs_nothing() -> None:
    running = account_attempt(AttemptEvidence(alloc(0, None), steps=steps(1, 2, 0.0)), set(), now=T0 + 30)
    assert running.allocated_s == pytest.approx(30.0)
    waiting = Allocation("7", T0, None, None, 0, 0, 0, "PENDING")
    assert account_attempt(AttemptEvidence(waiting), set(), now=T0 + 30).allocated_s == 0


def test_queue_wait_and_gaps_are_reported_not_billed() -> None:
    a = AttemptEvidence(alloc(10, 50, submit=T0))
    b = AttemptEvidence(alloc(80, 100))
    cost = bill(account_run([a, b], now=T0 + 1000))
    assert cost.unbilled_s == {"queue_wait": pytest.approx(10.0), "requeue_gap": pytest.approx(30.0)}
    assert cost.allocated_hours == pytest.approx((40 + 20) * 2 / 3600)


def test_cpu_hours_without_gpus_and_money() -> None:
    cpu = Allocation("9", None, T0, T0 + 3600, 0, 4, 2, "COMPLETED")
    cost = bill(account_run([AttemptEvidence(cpu)], now=T0 + 4000), price_per_hour=0.5)
    data = cost.to_json()
    assert data["unit"] == "cpu" and data["allocated_hours"] == pytest.approx(4.0)
    assert data["money"]["allocated"] == pytest.approx(2.0)


def test_status_cost_line_names_goodput_money_and_the_largest_waste() -> None:
    """``status --cost``'s line under the table: the bill's own figures, never recomputed."""
    from orchestrator.cli.cost import bill_line

    a = alloc(0, 100)  # 10 s start-up, 50 s of steps, a 40 s tail to the end (shutdown)
    data = bill(account_run([AttemptEvidence(a, steps=steps(1, 10, 10.0))], now=T0 + 1000), 2.0).to_json()
    line = bill_line("7", data)
    assert line.startswith(f"job 7: {data['allocated_hours']:.4f} GPU-hours allocated, goodput 50.0 %")
    assert f"{data['money']['allocated']:.2f} at 2/hour" in line
    assert line.endswith("most waste: shutdown (stop's save, exit) 40.0 %"), line
    nothing = bill(account_run([], now=T0), None).to_json()
    nothing["notes"] = ["no allocations from the local scheduler"]
    assert bill_line("local-1", nothing) == "job local-1: no bill: no allocations from the local scheduler"
    assert bill_line("9", {"error": "9: no such job"}) == "job 9: no bill: 9: no such job"


def test_every_bill_carries_one_label_per_category() -> None:
    """The command line and the dashboard read a category's label from the bill itself (one place)."""
    from orchestrator.cli.cost import render

    assert set(LABELS) == set(CATEGORIES) and next(iter(LABELS)) == "productive"
    a = alloc(0, 100)
    data = {
        "kind": "job",
        "target": "7",
        **bill(account_run([AttemptEvidence(a, steps=steps(1, 10, 10.0))], now=T0 + 1000)).to_json(),
    }
    assert data["labels"] == LABELS
    listed = [
        line.split("  ")[1].strip()
        for line in render(data).splitlines()[1:]
        if line.startswith("  ") and " h " in line
    ]
    assert listed == [LABELS[k] for k in LABELS if k == "productive" or data["hours"][k] > 0], listed


def test_the_sum_rule_holds_for_skewed_clocks() -> None:
    """Records a little outside the allocation (sacct's whole seconds) still sum to its length."""
    ev = AttemptEvidence(
        alloc(0, 30), steps=steps(1, 6, -1.0), evals=(EvalRecord(6, T0 + 31.5),), hang_last_progress=None
    )
    cost = account_attempt(ev, set(), now=T0 + 1000)
    assert sum(cost.seconds.values()) == pytest.approx(30.0)
    assert set(cost.seconds) == set(CATEGORIES)


def test_a_sweep_rollup_is_the_sum_of_its_tasks() -> None:
    tasks = [
        account_run(
            [
                AttemptEvidence(alloc(0, 60, job=f"5_{i}"), steps=steps(1, 8, 5.0 + i)),
                AttemptEvidence(alloc(100, 150, job=f"5_{i}"), steps=steps(5, 12, 105.0), start_step=4),
            ],
            now=T0 + 1000,
        )
        for i in range(3)
    ]
    parts = [bill(t) for t in tasks]
    whole = bill([a for t in tasks for a in t])
    assert whole.allocated_hours == pytest.approx(sum(p.allocated_hours for p in parts))
    for key in CATEGORIES:
        assert whole.hours[key] == pytest.approx(sum(p.hours[key] for p in parts))
    assert whole.hours["lost_work"] > 0


def test_slurm_accounting_lines() -> None:
    out = "\n".join(
        [
            "41|2026-11-26T08:00:00|2026-11-26T08:00:05|2026-11-26T08:02:05|billing=8,cpu=8,gres/gpu=4,mem=4G,node=2|REQUEUED",
            "41|2026-11-26T08:02:06|2026-11-26T08:04:10|Unknown|billing=8,cpu=8,gres/gpu=4,node=2|RUNNING",
            "41.batch|2026-11-26T08:02:06|2026-11-26T08:04:10|Unknown|cpu=4|RUNNING",
            "42|2026-11-26T08:00:00|Unknown|Unknown||PENDING",
        ]
    )
    found = parse_accounting(out)
    first, second = found["41"]
    assert (first.gpus, first.cpus, first.nodes, first.state) == (4, 8, 2, "REQUEUED")
    assert first.end is not None and first.start is not None and first.end - first.start == 120.0
    assert second.end is None
    assert found["42"][0].start is None
    assert parse_tres("cpu=2,gres/gpu:a100=3")["gres/gpu:a100"] == 3


def test_run_directory_records_become_evidence(tmp_path: Path) -> None:
    run = tmp_path / "run"
    lines = [
        {"event": "startup", "time": T0 + 1},
        {"event": "train", "step": 1, "step_time_s": 2.0, "time": T0 + 12},
        {"event": "train", "step": 2, "step_time_s": 2.0, "time": T0 + 14},
        {"event": "eval", "step": 2, "val_loss": 1.0, "time": T0 + 15},
        {"event": "train", "step": 2, "step_time_s": 2.0, "time": T0 + 112},
    ]
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"event": "tra')
    for attempt, at, start in ((0, T0 + 5, 0), (1, T0 + 105, 1)):
        folder = run / "logs" / f"attempt_{attempt}"
        folder.mkdir(parents=True)
        (folder / "start.json").write_text(json.dumps({"step": start, "checkpoint": None, "hook": "train"}))
        os.utime(folder / "start.json", (at, at))
    hang = run / "hang" / "attempt_0"
    hang.mkdir(parents=True)
    (hang / "hang.json").write_text(
        json.dumps({"heartbeats": {"0": {"time": T0 + 16}, "1": {"time": T0 + 14.5}}})
    )
    steps_read, evals_read = read_metrics(run)
    assert [s.step for s in steps_read] == [1, 2, 2] and [e.step for e in evals_read] == [2]
    first, second = gather(run, [alloc(0, 40), alloc(100, 130)])
    assert (first.attempt, first.start_step, first.hang_last_progress) == (0, 0, T0 + 16)
    assert [s.step for s in first.steps] == [1, 2] and len(first.evals) == 1
    assert (second.attempt, second.start_step, [s.step for s in second.steps]) == (1, 1, [2])
    costs = account_run([first, second], now=T0 + 1000)
    assert costs[0].lost_steps == 1  # step 2 trained again after the restore of step 1
    assert costs[0].seconds["hang"] == pytest.approx(24.0)


def test_a_step_past_the_recorded_end_counts_only_inside_it() -> None:
    """Accounting's whole seconds can end an allocation before its last step's record: the bill keeps
    to the allocation (nothing negative left unaccounted)."""
    late = AttemptEvidence(alloc(0, 19.5), steps=steps(1, 3, 5.0, gaps={2: 0.2}))
    cost = account_attempt(late, set(), now=T0 + 1000)
    assert cost.seconds["productive"] == pytest.approx(14.3)
    assert cost.seconds["checkpoint"] + cost.seconds["step_overhead"] == pytest.approx(0.2)
    assert cost.seconds["unaccounted"] == pytest.approx(0.0, abs=1e-9)
    assert min(cost.seconds.values()) >= 0
    # A cancelled job's recorded end is the cancel: its last steps ran after it (up to KillWait).
    after = account_attempt(
        AttemptEvidence(alloc(0, 3), steps=steps(1, 3, 3.0, 0.3, gaps={1: 0.1})), set(), T0 + 99
    )
    assert after.seconds["startup"] == pytest.approx(3.0) and min(after.seconds.values()) >= 0


def test_the_price_comes_from_the_profile_the_run_was_submitted_with(tmp_path: Path) -> None:
    from orchestrator.runner.cost import _price

    (tmp_path / "job.json").write_text(json.dumps({"profile": {"price_per_cpu_hour": 0.25}}))
    assert _price(tmp_path, "cpu") == 0.25 and _price(tmp_path, "gpu") is None


@pytest.mark.parametrize("value", ["-1.0", "-3", "cheap", ".inf"])
def test_a_bad_price_is_one_line_naming_the_key(value: str) -> None:
    from orchestrator.config.profile.load import parse_profile
    from orchestrator.contract.errors import UserError

    text = f"scheduler: local\nprice_per_gpu_hour: {value}\n"
    with pytest.raises(UserError) as err:
        parse_profile(text, "p.yaml")
    assert "price_per_gpu_hour" in str(err.value) and "\n" not in str(err.value)
    assert parse_profile("scheduler: local\nprice_per_gpu_hour: 2\n", "p.yaml").price_per_gpu_hour == 2


def test_cost_of_an_unknown_job_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from tests.helpers.cli import run_cli

    env = dict(os.environ, ORCHESTRATOR_HOME=str(tmp_path / "home"), ORCHESTRATOR_RUNS=str(tmp_path / "runs"))
    res = run_cli(["cost", "4711", "--json"], env, timeout=60)
    assert res.returncode == 2 and res.stdout == "", res.stdout + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "4711" in res.stderr
    assert "Traceback" not in res.stderr


def test_hours_until_a_moment_count_what_every_allocation_had_spent() -> None:
    from orchestrator.runner.cost_model import hours_until

    costs = account_run(
        [
            AttemptEvidence(alloc(0, 3600, gpus=1, job="5_0")),
            AttemptEvidence(alloc(1800, 5400, gpus=2, job="5_1")),
        ],
        now=T0 + 10_000,
    )
    assert hours_until(costs, T0 + 2700) == pytest.approx(0.75 + 2 * 0.25)
    assert hours_until(costs, T0 + 99_999) == pytest.approx(bill(costs).allocated_hours)
    assert hours_until(costs, T0 - 1) == 0


def test_the_table_names_every_category_spent_and_the_best_task() -> None:
    from orchestrator.cli.cost import render

    costs = account_run(
        [AttemptEvidence(alloc(0, 100), steps=steps(1, 10, 10.0), start_step=0)], now=T0 + 1000
    )
    data = {"kind": "sweep", "target": "77", **bill(costs, price_per_hour=3.0).to_json()}
    data["tasks"] = [{"task": 0, "job_id": "77_0", "allocated_hours": 0.05, "goodput": 0.5}]
    data["best"] = {"task": 0, "job_id": "77_0", "loss": 1.25, "step": 9, "hours_to_reach": 0.04}
    text = render(data)
    assert "goodput 50.0 %" in text and "start-up" in text and "shutdown" in text
    assert "best loss 1.2500: task 0 (77_0) at step 9" in text
    productive = next(line for line in text.splitlines() if "productive" in line)
    assert productive.split()[-1] == "0.08"  # 50 s x 2 GPUs = 0.0278 h at 3.0 an hour


def test_a_job_without_an_allocation_record_is_said_not_billed(tmp_path: Path) -> None:
    """A local job whose nodes recorded nothing (it never started): the bill says so instead of guessing."""
    from orchestrator.registry.store import Registry
    from orchestrator.runner.cost import cost_report

    run = tmp_path / "run"
    run.mkdir()
    with Registry.open(tmp_path / "home") as registry:
        registry.add_job(
            job_id="41",
            name="n",
            profile="local",
            scheduler="local",
            strategy="ddp",
            nodes=1,
            procs_per_node=1,
            command=["train.py"],
            run_dir=run,
        )
        report = cost_report(registry, "41").to_json()
    assert report["allocated_hours"] == 0 and report["goodput"] is None and report["attempts"] == []
    assert any("local scheduler" in n and "41" in n and "not billed" in n for n in report["notes"])


def test_a_successor_starting_as_its_predecessor_ends_gets_none_of_its_steps(tmp_path: Path) -> None:
    """requeue_as: new_job: the successor starts in the second the predecessor ends. Each step belongs
    to one allocation: the successor's start-up is its own, not zero from the predecessor's last steps."""
    from orchestrator.runner.cost_model import place

    assert place(T0 + 10.0, [(T0, T0 + 10.0), (T0 + 10.0, T0 + 20.0)]) == 0
    assert place(T0 + 10.5, [(T0, T0 + 10.0), (T0 + 11.0, T0 + 20.0)]) == 1  # nearer the second
    assert place(T0 + 30.0, [(T0, T0 + 10.0)]) is None
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {"event": "train", "step": s, "step_time_s": 0.5, "time": T0 + 9.0 + 0.5 * (s - 1)} for s in (1, 2, 3)
    ]
    lines += [
        {"event": "train", "step": s, "step_time_s": 0.5, "time": T0 + 10.0 + 4.0 + 0.5 * (s - 3)}
        for s in (4, 5)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    first, second = gather(run, [alloc(0, 10.2), alloc(10.2, 20)])
    assert [s.step for s in first.steps] == [1, 2, 3] and [s.step for s in second.steps] == [4, 5]
    cost = account_run([first, second], now=T0 + 100)[1]
    assert cost.seconds["startup"] == pytest.approx(14.0 - 0.5 - 10.2 + 0.5)
    assert min(cost.seconds.values()) >= 0


def test_a_long_gap_is_a_checkpoint_the_short_ones_the_step_boundary() -> None:
    """train/ saves between steps; every step boundary also costs a little (the ranks beat and write
    the metrics line). Only the gaps far over the usual one are checkpoint stalls."""
    gaps = {s: 0.01 for s in range(1, 20)} | {10: 1.5}
    ev = AttemptEvidence(alloc(0, 100), steps=steps(1, 20, 5.0, 0.1, gaps=gaps))
    s = account_attempt(ev, set(), now=T0 + 1000).seconds
    assert s["checkpoint"] == pytest.approx(1.5, abs=1e-5)
    assert s["step_overhead"] == pytest.approx(18 * 0.01, abs=1e-5)
    assert sum(s.values()) == pytest.approx(100.0)


def test_every_attempt_of_an_allocation_is_placed_on_its_timeline() -> None:
    """Restarts inside the allocation (restarts.jsonl): one allocation (0..100 s, 2 GPUs), attempt 0
    starts up to 10 s, trains steps 1-6 (5 s each) and fails at 40; the restart is recorded at 45;
    attempt 1 restored step 4 and trains steps 5-10 from 55 to 85. Each attempt gets its own part, the
    fault to training again is ``restart``, the steps trained twice are lost work, the parts sum up."""
    one = alloc(0, 100, submit=T0 - 3)
    first = AttemptEvidence(
        one, attempt=0, steps=steps(1, 6, 10.0), start_step=0, window=(T0, T0 + 45), restarted=True
    )
    second = AttemptEvidence(
        one, attempt=1, steps=steps(5, 10, 55.0), start_step=4, window=(T0 + 45, None), after_restart=True
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


def test_a_hung_attempt_restarted_in_its_allocation_is_hang_then_restart() -> None:
    """The watchdog ended attempt 0 (its last progress 42 s, 2 s into step 7): the hang runs to the
    restart's record, the next attempt's time to its first step is the restart."""
    one = alloc(0, 100)
    first = AttemptEvidence(
        one, steps=steps(1, 6, 10.0), hang_last_progress=T0 + 42, window=(T0, T0 + 45), restarted=True
    )
    second = AttemptEvidence(
        one, steps=steps(5, 10, 55.0), start_step=4, window=(T0 + 45, None), after_restart=True
    )
    a, b = account_run([first, second], now=T0 + 1000)
    assert a.seconds["hang"] == pytest.approx(3.0) and a.seconds["restart"] == 0
    assert a.seconds["lost_work"] == pytest.approx(12.0)
    assert b.seconds["restart"] == pytest.approx(10.0)
    assert sum(a.seconds.values()) + sum(b.seconds.values()) == pytest.approx(100.0)
    # A restarted attempt that never trained: its part of the allocation is all restart.
    idle = account_attempt(
        AttemptEvidence(one, window=(T0 + 45, T0 + 60), after_restart=True), set(), T0 + 99
    )
    assert idle.seconds["restart"] == pytest.approx(15.0) and idle.seconds["unaccounted"] == 0
