"""train/ inside container images on the real Slurm cluster: podman wrapping the node command, and
Slurm's own ``srun --container`` (an OCI bundle, runc through ``oci.conf``).

The image (``tests/helpers/container_image.py``) has Python, torch and accelerate and neither
orchestrator nor submitit: the node side reaches them through its read-only mounts. Each job is
compared with the same job run outside any container (``--profile local``, same world size), to
the bit: the ranks are provably inside (their mount namespace is not the host's, the image's marker
file is visible to them and not to the host), and the podman job is preempted with USR2 and resumes
exactly while ``orchestrator stacks`` reads both ranks' stacks inside.

An image nobody here built (``tests/helpers/debian_image.py``: Debian trixie by debootstrap, its own
Python 3.13 and a venv with torch and accelerate from PyPI) runs under Slurm's OCI support from
read-only storage: its ``/opt`` and ``/etc`` hold no mount point the node side needs (issue 41).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.contract.run_dir import preflight_dir, read_json
from orchestrator.rundir.summary import iter_metrics
from tests.helpers.cli import REPO, job_and_run_dir, kill_tree, run_cli, sacct_state, user_profile_dir
from tests.helpers.container_image import (
    MARKER,
    build_image,
    debian_image_once,
    forbidden_in_image,
    image_python,
)
from tests.helpers.debian_image import MARKER as DEBIAN_MARKER
from tests.helpers.debian_image import PYTHON as DEBIAN_PYTHON
from tests.helpers.debian_image import PYTHON_MINOR
from tests.helpers.hold import held, rank_pid
from tests.helpers.podman import podman_conf
from tests.helpers.preconditions import require_debian_packages

pytestmark = pytest.mark.slow
TRAIN = str(REPO / "train" / "train.py")
STEPS = 8
TRAIN_ARGS = ["--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64",
              "--max-steps", str(STEPS), "--log-every", "1"]  # fmt: skip
OPTIONS = [
    "--strategy",
    "full_shard",
    "--wrap-cls",
    "TransformerBlock",
    "--nodes",
    "2",
    "--procs-per-node",
    "1",
]


@pytest.fixture(scope="module")
def image() -> Path:
    require_debian_packages("podman", "runc")
    rootfs = build_image()
    assert forbidden_in_image(rootfs) == [], "the test image must not contain orchestrator or submitit"
    return rootfs


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    """The same job outside any container, started once in the background."""
    runs = tmp_path_factory.mktemp("reference")
    env = {**os.environ, "ORCHESTRATOR_HOME": str(runs / "home"), "ORCHESTRATOR_RUNS": str(runs),
           "PYTHONPATH": str(REPO)}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "submit", "--profile", "local", *OPTIONS, "--wait", "--poll",
         "0.5", "--", TRAIN, *TRAIN_ARGS],
        cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    yield proc
    kill_tree(proc.pid)
    for pids in runs.glob("*/local_pids.json"):
        for pid in json.loads(pids.read_text()).values():
            kill_tree(int(pid))


_REFERENCE_LOSSES: dict[int, list[float]] = {}


def _reference_losses(proc: subprocess.Popen[str]) -> list[float]:
    """The reference job's losses (waited for once, bounded)."""
    if proc.pid not in _REFERENCE_LOSSES:
        try:
            out = proc.communicate(timeout=400)[0]
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            raise AssertionError("the reference job outside a container did not finish in 400 s") from None
        assert proc.returncode == 0, out
        run_dir = job_and_run_dir(out)[1]
        events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        _REFERENCE_LOSSES[proc.pid] = [e["loss"] for e in events if e.get("event") == "train"]
        assert len(_REFERENCE_LOSSES[proc.pid]) == STEPS
    return _REFERENCE_LOSSES[proc.pid]


def _oci_conf(cluster: dict[str, str]) -> None:
    """Slurm's OCI runtime for ``srun --container``: runc (crun refuses this machine's hybrid cgroups).
    slurmstepd reads oci.conf when a step asks for a container, so writing it next to slurm.conf is
    enough; steps without --container never read it."""
    conf = Path(cluster["ORCHESTRATOR_TEST_CLUSTER_BASE"]) / "etc" / "oci.conf"
    state = "--root=/run/orchestrator-test-oci"
    conf.write_text(
        f'RunTimeQuery="runc {state} state %n.%u.%j.%s.%t"\n'
        f'RunTimeRun="runc {state} run --bundle %b %n.%u.%j.%s.%t"\n'
        f'RunTimeKill="runc {state} kill -a %n.%u.%j.%s.%t"\n'
        f'RunTimeDelete="runc {state} delete --force %n.%u.%j.%s.%t"\n'
    )


def _ranks_inside(run_dir: Path, marker: str = MARKER) -> None:
    """Rank 0 runs in another mount namespace than this test, and sees the image's marker file."""
    pid = rank_pid(run_dir, 0, min_step=1)
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    assert Path(f"/proc/{pid}/root/{marker}").exists()
    assert not Path("/", marker).exists()


def _versions_in_logs(job_id: str, orch_env: dict, python: str) -> None:
    """The node log's line with the image's Python, torch and accelerate, as ``orchestrator logs``
    shows it (not only submitit's own file)."""
    shown = run_cli(["logs", job_id], orch_env, timeout=60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    line = next((x for x in shown.stdout.splitlines() if "orchestrator container: python" in x), "")
    assert f"python {python}" in line and "torch 2.13.0" in line and "accelerate 1.15.0" in line, shown.stdout


def _stacks_of_both_ranks(job_id: str, orch_env: dict) -> None:
    """``orchestrator stacks`` reads every rank's Python stack inside the container (py-spy from the
    host, through the shared pid namespace): rank 0 stopped in training, rank 1 waiting for it."""
    res = run_cli(["stacks", job_id], orch_env, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    found = sorted(x for x in res.stdout.splitlines() if x.startswith(("rank 0 node ", "rank 1 node ")))
    # Rank 0 is stopped wherever the SIGSTOP landed (in a collective or not); rank 1 waits in one.
    assert len(found) == 2 and " stopped, " in found[0] and "inside a collective" in found[1], res.stdout
    folder = Path(res.stdout.split(" in ")[-1].strip())
    for rank in (0, 1):
        text = (folder / f"rank_{rank}.txt").read_text()
        assert "train.py" in text, text


def _submit(orch_env: dict, profiles: Path, extra_env: dict[str, str] | None = None) -> tuple[str, Path]:
    res = run_cli(
        [
            "submit",
            "--profile",
            "slurm_test",
            "--profiles-dir",
            str(profiles),
            *OPTIONS,
            "--",
            TRAIN,
            *TRAIN_ARGS,
        ],
        {**orch_env, **(extra_env or {})},
        timeout=90,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return job_and_run_dir(res.stdout)


def _node_logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "submitit").glob("*_log.err")))


def _check_losses(run_dir: Path, want: list[float]) -> None:
    got = [(e["step"], e["loss"]) for e in iter_metrics(run_dir) if e.get("event") == "train"]
    assert sorted({step for step, _ in got}) == list(range(1, STEPS + 1)), got
    differ = {step: (loss, want[step - 1]) for step, loss in got if loss != want[step - 1]}
    assert not differ, f"losses differ from the run outside a container at (got, want): {differ}"


def test_podman_two_node_full_shard_preempted_resumes_exactly(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path, image: Path, reference: subprocess.Popen[str]
) -> None:
    container = {"runtime": "podman", "image": str(image), "python": image_python()}
    profiles = user_profile_dir(tmp_path, container=container)
    job_id, run_dir = _submit(orch_env, profiles, {"CONTAINERS_CONF": str(podman_conf(tmp_path))})
    try:
        _ranks_inside(run_dir)
        with held(rank_pid(run_dir, 0, min_step=3), [signal.SIGUSR2]):
            _stacks_of_both_ranks(job_id, orch_env)
            sent = run_cli(["cancel", job_id, "--signal", "USR2"], orch_env, timeout=60)
            assert sent.returncode == 0, sent.stdout + sent.stderr
        waited = run_cli(["wait", job_id, "--timeout", "300"], orch_env, timeout=320)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
    assert waited.returncode == 0, waited.stdout + waited.stderr + _node_logs(run_dir)[-4000:]
    assert sacct_state(job_id) == "COMPLETED"
    resumed = [e for e in iter_metrics(run_dir) if e.get("event") == "resume"]
    assert len(resumed) == 1 and 3 <= resumed[0]["step"] < STEPS, resumed
    _versions_in_logs(job_id, orch_env, f"{sys.version_info.major}.{sys.version_info.minor}")
    _check_losses(run_dir, _reference_losses(reference))


def test_slurm_oci_container_two_node_full_shard_equals_outside(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path, image: Path, reference: subprocess.Popen[str]
) -> None:
    _oci_conf(slurm_cluster)
    container = {"runtime": "oci", "image": str(image), "python": image_python()}
    profiles = user_profile_dir(tmp_path, container=container)
    job_id, run_dir = _submit(orch_env, profiles)
    try:
        _ranks_inside(run_dir)
        waited = run_cli(["wait", job_id, "--timeout", "300"], orch_env, timeout=320)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
    assert waited.returncode == 0, waited.stdout + waited.stderr + _node_logs(run_dir)[-4000:]
    assert "--container=" in (run_dir / "sbatch.sh").read_text()
    _check_losses(run_dir, _reference_losses(reference))


@pytest.fixture
def read_only_debian_image(tmp_path: Path) -> Iterator[Path]:
    """The Debian image (built on first use, cached), seen through a read-only bind mount: a mount
    point made in it fails, as on read-only storage (a squashfs, a shared image store)."""
    built = debian_image_once()
    assert forbidden_in_image(built) == [], "the Debian image must not contain orchestrator or submitit"
    image = tmp_path / "debian-image"
    image.mkdir()
    subprocess.run(["mount", "--bind", str(built), str(image)], check=True, timeout=30)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(image)], check=True, timeout=30)
        yield image
    finally:
        subprocess.run(["umount", "-l", str(image)], timeout=30, check=False)


def test_slurm_oci_runs_an_image_nobody_here_built_from_read_only_storage(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path, read_only_debian_image: Path,
    reference: subprocess.Popen[str],
) -> None:  # fmt: skip
    """runc failed at container init with this image ("mkdir .../opt/orchestrator: read-only file
    system"): now both nodes train in it, every loss equal to the run outside a container, and
    ``orchestrator logs`` shows the image's own Python (another minor than this machine's)."""
    _oci_conf(slurm_cluster)
    container = {"runtime": "oci", "image": str(read_only_debian_image), "python": DEBIAN_PYTHON}
    profiles = user_profile_dir(tmp_path, container=container)
    job_id, run_dir = _submit(orch_env, profiles)
    try:
        _ranks_inside(run_dir, DEBIAN_MARKER)
        waited = run_cli(["wait", job_id, "--timeout", "300"], orch_env, timeout=320)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
    assert waited.returncode == 0, waited.stdout + waited.stderr + _node_logs(run_dir)[-4000:]
    assert f"{sys.version_info.major}.{sys.version_info.minor}" != PYTHON_MINOR
    _versions_in_logs(job_id, orch_env, PYTHON_MINOR)
    _check_losses(run_dir, _reference_losses(reference))


def test_an_image_missing_on_one_node_fails_the_preflight_naming_that_node(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    """Each node's podman storage is its own (a node-local image store, as on a real cluster): the
    profile's set-up lines pick ``storage-<node>.conf``, and only the first node's store holds the
    image. The preflight's tasks run the set-up lines as the node tasks do, so the node without it
    is named, the job FAILS before any rank starts, and status says why."""
    require_debian_packages("podman", "runc")
    names = slurm_cluster["ORCHESTRATOR_TEST_CLUSTER_NODE_NAMES"].split(",")
    image = "localhost/orchestrator-preflight-test:1"
    for node in names:
        store = tmp_path / f"store-{node}"
        (tmp_path / f"storage-{node}.conf").write_text(
            f'[storage]\ndriver = "vfs"\ngraphroot = "{store}"\nrunroot = "{store}-run"\n'
        )
    (tmp_path / "image").mkdir()
    (tmp_path / "image" / "marker").write_text("a one-file image: the preflight only asks if it is there\n")
    subprocess.run(
        ["tar", "-C", str(tmp_path / "image"), "-cf", str(tmp_path / "image.tar"), "."], check=True
    )
    podman_env = {**os.environ, "CONTAINERS_CONF": str(podman_conf(tmp_path)),
                  "CONTAINERS_STORAGE_CONF": str(tmp_path / f"storage-{names[0]}.conf")}  # fmt: skip
    imported = subprocess.run(["podman", "import", str(tmp_path / "image.tar"), image], env=podman_env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    setup = [f'export CONTAINERS_STORAGE_CONF={tmp_path}/storage-"${{SLURMD_NODENAME:-$(hostname)}}".conf']
    profiles = user_profile_dir(tmp_path, container={"runtime": "podman", "image": image}, setup=setup,
                                preflight={"enabled": True, "timeout_s": 60})  # fmt: skip
    job_id, run_dir = _submit(orch_env, profiles, {"CONTAINERS_CONF": str(podman_conf(tmp_path))})
    try:
        waited = run_cli(["wait", job_id, "--timeout", "180"], orch_env, timeout=200)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
    assert waited.returncode == 1, waited.stdout + waited.stderr
    verdict = read_json(preflight_dir(run_dir, 0) / "preflight.json")
    assert verdict is not None and verdict["failed"], verdict
    allocated = verdict["nodes"]
    assert names[0] in allocated, verdict
    missing = [n for n in allocated if n != names[0]]
    assert verdict["bad_nodes"] == missing, verdict
    for node in missing:
        assert f"node {node}: container image {image} not in this node's podman storage" in verdict["reason"]
    assert f"node {names[0]}:" not in verdict["reason"], verdict
    rows = json.loads(run_cli(["status", job_id, "--json"], orch_env).stdout)["jobs"]
    assert f"preflight failed: node {missing[0]}" in rows[0]["reason"], rows
    assert not list(run_dir.glob("checkpoints/step_*")), "no rank may have trained"
