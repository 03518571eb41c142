"""``orchestrator ui`` in a real browser: Debian's headless Chromium, driven by Selenium through Debian's
chromedriver, against real local jobs (a sweep, a failed job with a hostile name, a running job).

One registry, one dashboard process and one browser for the module. Screenshots of every page go to
``build/test-artifacts/ui/``; ``UPDATE_SCREENSHOTS=1`` also writes docs/dashboard.md's ``docs/ui_job.png``
and ``docs/ui_sweep.png`` from the same pages.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cli import REPO, kill_tree, poll, run_cli
from tests.helpers.preconditions import require_debian_packages, require_modules

pytestmark = pytest.mark.browser

SWEEP_TASK = str(REPO / "tests" / "scripts" / "sweep_task.py")
CRASH = str(REPO / "tests" / "scripts" / "crash_rank.py")
ARTIFACTS = REPO / "build" / "test-artifacts" / "ui"
DOCS = REPO / "docs"
HOSTILE_NAME = "<img src=x onerror=window.__pwned=1><script>window.__pwned=2</script>"
HOSTILE_ERROR = "<script>window.__pwned=3</script> & <b>bold</b>"
ONE = ["--profile", "local", "--nodes", "1", "--procs-per-node", "1"]


class Dashboard:
    def __init__(self, env: dict[str, str], url: str, proc: subprocess.Popen[str]) -> None:
        self.env, self.url, self.proc = env, url, proc
        self.ids: dict[str, str] = {}


def _submitted(res: subprocess.CompletedProcess[str], what: str) -> str:
    assert res.returncode == 0, res.stdout + res.stderr
    m = re.search(rf"submitted {what} (\S+)", res.stdout)
    assert m, res.stdout
    return m.group(1)


def _status(env: dict[str, str], ident: str) -> dict[str, Any]:
    res = run_cli(["status", ident, "--json"], env, timeout=60)
    assert res.returncode == 0, res.stderr
    data: dict[str, Any] = json.loads(res.stdout)
    return data


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:
    require_modules("plotly", "selenium")
    tmp = tmp_path_factory.mktemp("ui")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env.update(ORCHESTRATOR_HOME=str(tmp / "home"), ORCHESTRATOR_RUNS=str(tmp / "runs"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    ids: dict[str, str] = {}
    ids["sweep"] = _submitted(
        run_cli(
            ["sweep", *ONE, "--grid", "lr=0.3,0.1,0.2", "--", SWEEP_TASK, "--lr", "{lr}", "--steps", "4"], env
        ),
        "sweep",
    )
    ids["failed"] = _submitted(
        run_cli(
            [
                "submit",
                *ONE,
                "--name",
                HOSTILE_NAME,
                "--",
                CRASH,
                "--crash-rank",
                "0",
                "--error",
                HOSTILE_ERROR,
            ],
            env,
        ),
        "job",
    )
    # Long enough to be RUNNING while the browser watches its chart grow (ended by the teardown).
    ids["running"] = _submitted(
        run_cli(
            ["submit", *ONE, "--name", "growing", "--", SWEEP_TASK, "--steps", "400", "--step-s", "0.3"], env
        ),
        "job",
    )
    # Held inside step 4 until its test stops it (USR2: checkpoint, PREEMPTED), then resumed as another job.
    hold = ["--lr", "0.1", "--hold-lr", "0.1", "--hold-at", "4", "--steps", "8", "--step-s", "0.1"]
    ids["preempted"] = _submitted(
        run_cli(["submit", *ONE, "--name", "resumed", "--", SWEEP_TASK, *hold], env), "job"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "ui", "--port", "0", "--refresh", "0.5"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the server prints its address once it listens
        m = re.search(r"serving (http://127\.0\.0\.1:\d+/)", line)
        assert m, f"no address from orchestrator ui: {line!r}"
        board = Dashboard(env, m.group(1), proc)
        board.ids = ids
        yield board
    finally:
        kill_tree(proc.pid)
        for pids in [
            *(tmp / "runs").glob("*/local_pids.json"),
            *(tmp / "runs").glob("*/task_*/local_pids.json"),
        ]:
            for pid in json.loads(pids.read_text()).values():
                kill_tree(int(pid))


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require_debian_packages("chromium", "chromium-driver")
    require_modules("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: Any, script: str, what: str, timeout: float = 60.0) -> Any:
    """Poll a JavaScript expression in the page until it is truthy (bounded)."""
    return poll(lambda: driver.execute_script("return " + script) or None, timeout, what, interval=0.2)


def _shot(driver: Any, name: str, docs_name: str | None = None) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / name))
    if docs_name and os.environ.get("UPDATE_SCREENSHOTS") == "1":
        DOCS.mkdir(exist_ok=True)
        driver.save_screenshot(str(DOCS / docs_name))


def _no_script_ran(driver: Any) -> None:
    assert driver.execute_script("return window.__pwned") is None
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors  # no blocked inline script, no failed request, no JS error


def test_jobs_page_lists_the_registry(dashboard: Dashboard, browser: Any) -> None:
    poll(
        lambda: _status(dashboard.env, dashboard.ids["failed"])["jobs"][0]["state"] == "FAILED" or None,
        240,
        "the crashing job failed",
        interval=1.0,
    )
    from orchestrator.registry.store import Registry

    with Registry.open(Path(dashboard.env["ORCHESTRATOR_HOME"])) as registry:
        registered = sorted(j.job_id for j in registry.list_jobs())
    browser.get(dashboard.url)
    shown = _wait(
        browser,
        f"document.querySelectorAll('tr[data-job]').length === {len(registered)} && "
        "Array.from(document.querySelectorAll('tr[data-job]')).map(r => r.dataset.job)",
        "every job of the registry listed",
    )
    assert sorted(shown) == registered
    names = browser.execute_script(
        "return Array.from(document.querySelectorAll('td.name')).map(td => td.textContent)"
    )
    assert HOSTILE_NAME in names  # the name as text: no <img>, no <script> made of it
    assert browser.execute_script("return document.querySelectorAll('main img, main script').length") == 0
    # The state filter: only the failed job.
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "filter-state")).select_by_value("FAILED")
    _wait(
        browser,
        "Array.from(document.querySelectorAll('tr[data-job]')).map(r => r.dataset.job).join() === "
        + json.dumps(dashboard.ids["failed"]),
        "only the failed job after filtering",
    )
    _shot(browser, "jobs.png")
    _no_script_ran(browser)


def test_failed_job_shows_reason_logs_command_and_escaped_text(dashboard: Dashboard, browser: Any) -> None:
    job = dashboard.ids["failed"]
    row = poll(
        lambda: (r := _status(dashboard.env, job)["jobs"][0])["reason"] and r,
        240,
        "the failed job explained",
        interval=1.0,
    )
    browser.get(dashboard.url + "job/" + job)
    reason = _wait(browser, "document.getElementById('reason-text')?.textContent", "the failure reason shown")
    assert reason == row["reason"]  # status's own sentence
    command = browser.find_element("id", "reason-command").text
    assert command.startswith(f"orchestrator logs {job}") and "--rank 0" in command
    log_text = _wait(
        browser,
        "(t => t.includes('<script>') && t)(document.getElementById('log-lines')?.textContent || '')",
        "the log line holding <script> shown as text",
    )
    assert HOSTILE_ERROR in log_text
    assert (
        browser.execute_script("return document.querySelectorAll('main script, main b, main img').length")
        == 0
    )
    # Searching the log: only lines holding the word.
    search = browser.find_element("id", "log-search")
    search.send_keys("ValueError\n")
    # Filtered once every line holds the word (node 0's own "not restarted in place: ... ValueError"
    # line among them: with max_restarts it says why the error was not restarted).
    lines = _wait(
        browser,
        "(t => t && t.split('\\n').filter(l => l.trim()).every(l => l.toLowerCase().includes('valueerror')) && t)"
        "(document.getElementById('log-lines').textContent)",
        "the search's lines",
    )
    assert all("valueerror" in ln.lower() for ln in lines.splitlines()), lines
    _shot(browser, "job_failed.png")
    _no_script_ran(browser)


def test_running_job_chart_gains_points_without_reload(dashboard: Dashboard, browser: Any) -> None:
    job = dashboard.ids["running"]
    browser.get(dashboard.url + "job/" + job)
    browser.execute_script("window.__same_page = true")
    first = int(
        _wait(
            browser,
            "(n => n > 0 && n)(Number(document.getElementById('chart-loss')?.dataset.points || 0))",
            "the first points drawn",
            timeout=180,
        )
    )
    grown = _wait(
        browser,
        f"(n => n > {first} && n)(document.getElementById('chart-loss').data?.[0]?.x?.length || 0)",
        "the chart gaining points",
        timeout=60,
    )
    assert grown > first
    assert browser.execute_script("return window.__same_page") is True  # no reload happened
    state = browser.execute_script("return document.querySelector('#summary .state').textContent")
    assert state.startswith("RUNNING"), state
    _shot(browser, "job_running.png")
    _no_script_ran(browser)


def test_sweep_page_highlights_the_best_task(dashboard: Dashboard, browser: Any) -> None:
    sweep = dashboard.ids["sweep"]
    data = poll(
        lambda: (d := _status(dashboard.env, sweep))["counts"] == {"COMPLETED": 3} and d,
        240,
        "the sweep's three tasks completed",
        interval=1.0,
    )
    assert data["best_task"] == 1  # lr 0.1 (tests/scripts/sweep_task.py's arithmetic)
    browser.get(dashboard.url + "sweep/" + sweep)
    best = _wait(browser, "document.querySelector('tr.best')?.dataset.task", "a task highlighted")
    assert best == "1"
    cells = browser.execute_script(
        "return Array.from(document.querySelectorAll('tr.best td')).map(td => td.textContent)"
    )
    assert cells[1] == "0.1"
    points = _wait(
        browser, "document.getElementById('sweep-chart-0')?.data?.[0]?.x", "the metric vs lr chart"
    )
    assert sorted(points) == [0.1, 0.2, 0.3]
    _shot(browser, "sweep.png", "ui_sweep.png")
    _no_script_ran(browser)


def test_resumed_run_shows_both_attempts_on_one_axis(dashboard: Dashboard, browser: Any) -> None:
    env, first = dashboard.env, dashboard.ids["preempted"]
    run_dir = Path(_status(env, first)["jobs"][0]["run_dir"])
    poll(
        lambda: (run_dir / "holding.json").exists(), 180, "the first attempt holding in step 4", interval=0.3
    )
    assert run_cli(["cancel", first, "--signal", "USR2"], env, timeout=60).returncode == 0
    res = run_cli(["wait", first, "--timeout", "120"], env, timeout=150)
    assert "PREEMPTED" in res.stdout, res.stdout + res.stderr
    res = run_cli(["resume", first], env, timeout=60)
    second = _submitted(res, "job")
    assert run_cli(["wait", second, "--timeout", "240"], env, timeout=270).returncode == 0
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    resumed_at = [e["step"] for e in events if e.get("event") == "resume"]
    assert resumed_at == [4], events
    browser.get(dashboard.url + "job/" + second)
    shapes = _wait(
        browser,
        "(c => c && c.layout && c.data[0].x.length === 8 && c.layout.shapes)(document.getElementById('chart-loss'))",
        "the whole run's 8 steps and the resume marker",
    )
    assert [shape["x0"] for shape in shapes] == resumed_at  # the resume point, dashed, on the one axis
    rows = browser.execute_script(
        "return Array.from(document.querySelectorAll('#attempts tbody tr')).map(r => r.textContent)"
    )
    assert len(rows) == 2 and f"step {resumed_at[0]}" in rows[1], rows
    # The bill's section (`orchestrator cost`): a local run is billed from its nodes' own records, in
    # CPU-hours (both jobs of the run: the preempted one and its resume).
    bill = _wait(browser, "(e => e && e.textContent)(document.getElementById('cost'))", "the cost section")
    assert bill.startswith("where the hours went") and "CPU-hours allocated" in bill, bill
    assert "productive (steps kept)" in bill and "no bill" not in bill, bill
    _shot(browser, "job_resumed.png", "ui_job.png")
    _no_script_ran(browser)
