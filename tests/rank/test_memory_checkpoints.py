"""Memory checkpoints restore exactly and refuse as one: real Accelerate + FSDP2 over a real
2-process gloo group (tests/scripts/memory_checkpoint_probe.py), real files in a folder of them.

A restored step 3 is step 3's parameters, optimizer state (DTensors), param groups, scheduler and
global RNG, to the bit: step 4 trained again has step 4's loss. A memory checkpoint one rank cannot
read is refused on every rank before any rank changed anything (a rank that restored alone would
train from another state than its peers)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.contract.memory_checkpoints import (
    AUTO_MEMORY_CKPT_PROBE_STEP,
    auto_memory_ckpt_every,
    job_memory_ckpt_prefix,
    memory_ckpt_file,
    memory_ckpt_holdings,
    memory_ckpt_steps,
    newest_common_step,
    newest_step_held,
    node_memory_ckpt_dir,
    parse_memory_ckpt_every,
    replica_owner,
    replica_peer,
    transfers,
)
from orchestrator.rank.memory_replicas import remove_torn_files
from tests.helpers.cli import REPO, kill_tree
from tests.helpers.net import free_port
from tests.rank.test_shard_plan import ENV  # the same FSDP2-on-CPU launch

PROBE = REPO / "tests" / "scripts" / "memory_checkpoint_probe.py"


def probe(mode: str, out: Path, said: list[str] | None = None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "ORCHESTRATOR_"))}
    launch = ENV if not mode.startswith("ddp") else {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    env.update(
        launch, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    )
    env["ORCHESTRATOR_MEMORY_CKPT_DIR"] = str(out / "private" / "node0")  # made 0700 by the ranks
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(PROBE), mode, str(out)],
        env=env, capture_output=True, text=True, timeout=240, cwd=out,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    if said is not None:
        said.append(res.stderr)
    return [json.loads((out / f"result_{rank}.json").read_text()) for rank in (0, 1)]


def as_nodes(mode: str, out: Path, folders: tuple[Path, ...]) -> list[dict]:
    """The probe as nodes of one rank each (a torchrun agent per node, on loopback), each node with its
    own memory checkpoint folder, as hosts have."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "ORCHESTRATOR_"))}
    env.update(ENV, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    port = str(free_port())
    procs = []
    for node, folder in enumerate(folders):
        node_env = {**env, "ORCHESTRATOR_MEMORY_CKPT_DIR": str(folder)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(folders)), "--node_rank",
             str(node), "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
             str(PROBE), mode, str(out)],
            env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out,
        ))  # fmt: skip
    try:
        said = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        for proc in procs:
            kill_tree(proc.pid)
    assert all(proc.returncode == 0 for proc in procs), "\n".join(s[-3000:] for s in said)
    return [json.loads((out / f"{mode}_{rank}.json").read_text()) for rank in range(len(folders))]


@pytest.mark.slow
def test_two_neighbouring_nodes_lost_together_their_memory_checkpoints_come_back_to_the_bit(
    tmp_path: Path,
) -> None:
    """Four nodes of one rank: every rank's memory checkpoint is copied half the nodes away (node 0's to
    node 2 and back, node 1's to node 3). Nodes A and B, neighbours (one rack), are lost together. C
    and D come first (on Slurm the nodes after the lost ones move up), and two empty spares take places
    2 and 3. All four ranks restore step 3, to the bit: the survivors their new ranks' files from the
    copies A and B sent them, the spares theirs from C and D, sent at the restore. With the copy on
    the next node (before), A's file and its copy on B went together: no step to restore."""
    private = tmp_path / "private"
    a, b, c, d, spare_1, spare_2 = (private / name for name in ("a", "b", "c", "d", "spare_1", "spare_2"))
    saved = as_nodes("nodes-save", tmp_path, (a, b, c, d))
    assert all(got["linked"] for got in saved), saved
    for folder, own, copy in ((a, 0, 2), (b, 1, 3), (c, 2, 0), (d, 3, 1)):
        assert memory_ckpt_holdings(folder, 4) == {own: [3, 2], copy: [3, 2]}, folder
    for owner, holder in ((0, c), (1, d), (2, a), (3, b)):  # the copy is the file, byte for byte
        assert (
            memory_ckpt_file(holder, 4, owner, 3).read_bytes()
            == memory_ckpt_file((a, b, c, d)[owner], 4, owner, 3).read_bytes()
        )
    assert saved[2]["received_bytes"] == memory_ckpt_file(a, 4, 0, 3).stat().st_size
    shutil.rmtree(a)  # nodes A and B are lost, their memory with them: stand-ins for the lost hosts
    shutil.rmtree(b)
    swapped = as_nodes("nodes-swap", tmp_path, (c, d, spare_1, spare_2))
    for rank, got in enumerate(swapped):
        assert got["common"] == 3 and got["refused"] is None, got
        assert got["equals_step_3"], (rank, got)
        assert got["loss_4"] == saved[rank]["loss_4"], (rank, got, saved[rank])
    assert memory_ckpt_steps(spare_1, 4, 2) == [3] and memory_ckpt_steps(spare_2, 4, 3) == [3]  # sent by C, D
    # After the restore each survivor keeps its new rank's files and the copies it holds for that
    # rank's owner (half-way: rank 0's node holds rank 2's), and nothing else.
    assert memory_ckpt_holdings(c, 4) == {0: [3, 2], 2: [3, 2]} and memory_ckpt_holdings(d, 4) == {
        1: [3, 2],
        3: [3, 2],
    }


@pytest.mark.slow
def test_a_restored_memory_checkpoint_is_the_step_it_was_taken_at_to_the_bit(tmp_path: Path) -> None:
    for rank, got in enumerate(probe("fit", tmp_path)):
        assert got["common"] == 3 and got["refused"] is None, got
        assert got["equals_step_3"] and not got["equals_step_5"], (rank, got)
        assert got["sched_is_step"] == 3, got
        assert got["loss_4_again"] == got["loss_4"], got
    assert memory_ckpt_steps(tmp_path / "private" / "node0", 2, 1) == [3]


@pytest.mark.slow
def test_a_memory_checkpoint_one_rank_cannot_read_is_refused_on_every_rank_changing_nothing(
    tmp_path: Path,
) -> None:
    for rank, got in enumerate(probe("corrupt", tmp_path)):
        assert got["common"] == 3, got
        assert str(got["refused"]).startswith("rank 1: "), got  # both ranks learn rank 1's words
        assert got["equals_step_5"] and not got["equals_step_3"], (rank, got)
        assert got["sched_is_step"] == 5, got


@pytest.mark.slow
def test_a_folder_another_user_could_write_to_is_never_used(tmp_path: Path) -> None:
    """``/dev/shm`` is everyone's: where ``orchestrator-<uid>`` is not this user's alone, the ranks
    neither write their state there nor load a pickle from it; training goes on."""
    said: list[str] = []
    for got in probe("open", tmp_path, said):
        assert got["common"] is None and got["equals_step_5"], got
    assert said[0].count("memory checkpoints off on rank") == 2, said[0][-2000:]
    assert "is not a folder of this user's alone" in said[0], said[0][-2000:]
    assert memory_ckpt_steps(tmp_path / "private" / "node0", 2, 0) == []


@pytest.mark.slow
def test_ddp_ranks_on_a_node_keep_one_copy_of_the_model_and_restore_from_it_to_the_bit(
    tmp_path: Path,
) -> None:
    """DDP ranks hold the same parameters and optimizer state: only the node's first rank writes them
    (eight ranks on a node wrote eight copies at every save); rank 1 restores its step from them, and
    without rank 0's file no rank restores anything."""
    results = probe("ddp", tmp_path)
    for rank, got in enumerate(results):
        assert got["common"] == 3 and got["refused"] is None, got
        assert got["equals_step_3"] and not got["equals_step_5"], (rank, got)
        assert got["sched_is_step"] == 3 and got["loss_4_again"] == got["loss_4"], got
    whole, replica = results[0]["file_bytes"]
    assert replica * 20 < whole, results[0]  # buffers, RNG and the scheduler, not the model and AdamW
    # Rank 1's own file names rank 0's for the tensors: without that one it is no memory checkpoint.
    assert [got["common_without_rank_0"] for got in results] == [None, None], results


@pytest.mark.slow
def test_auto_measures_one_save_and_every_rank_takes_the_interval_of_the_slowest(tmp_path: Path) -> None:
    """``every="auto"``: the attempt's fifth step saves and is timed against the steps before it; the
    ranks agree on the slowest save and step (rank 1 sleeps 50 ms a step), and save on that interval."""
    results = probe("auto", tmp_path)
    assert results[0]["measured"] == results[1]["measured"], results
    save_s, step_s = results[0]["measured"]
    assert save_s == max(r["own_save"] for r in results), results
    assert step_s >= 0.05, results  # rank 1's sleep is in everyone's measured step
    every = auto_memory_ckpt_every(save_s, step_s, 50)
    assert [r["every"] for r in results] == [every, every] and every > 0, results
    later = [n for n in range(AUTO_MEMORY_CKPT_PROBE_STEP + 1, 9) if n % every == 0]
    assert [r["saved"] for r in results] == [[AUTO_MEMORY_CKPT_PROBE_STEP, *later]] * 2, results


def test_auto_takes_the_fewest_steps_within_its_share_aligned_to_the_shared_interval() -> None:
    assert auto_memory_ckpt_every(0.19, 1.0, 0) == 10  # 0.19 s every 10 steps of 1 s: under 2 %
    assert auto_memory_ckpt_every(0.19, 1.0, 500) == 10
    assert auto_memory_ckpt_every(0.21, 1.0, 500) == 20  # 11 needed, 20 divides 500
    assert auto_memory_ckpt_every(0.19, 1.0, 15) == 10  # no divisor of 15 in 10..14
    assert auto_memory_ckpt_every(0.19, 1.0, 10) == 0  # only as rarely as the shared checkpoint
    assert auto_memory_ckpt_every(0.001, 1.0, 50) == 1
    assert [parse_memory_ckpt_every(t) for t in ("auto", "5", "0")] == ["auto", 5, 0]
    for bad in ("-1", "x", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole number of steps"):
            parse_memory_ckpt_every(bad)


def test_only_whole_memory_checkpoints_of_this_rank_and_world_count(tmp_path: Path) -> None:
    for world, rank, step in ((2, 0, 4), (2, 0, 8), (2, 1, 8), (4, 0, 12)):
        memory_ckpt_file(tmp_path, world, rank, step).write_bytes(b"x")
    (tmp_path / f".{memory_ckpt_file(tmp_path, 2, 0, 12).name}.123.tmp").write_bytes(b"torn")
    assert memory_ckpt_steps(tmp_path, 2, 0) == [8, 4]
    assert memory_ckpt_steps(tmp_path, 2, 1) == [8]
    assert memory_ckpt_steps(tmp_path / "missing", 2, 0) == []
    assert newest_common_step([[8, 4], [8]]) == 8
    assert newest_common_step([[12, 8], [8, 4]]) == 8  # one rank was writing 12 when it stopped
    assert newest_common_step([[4], [8]]) is None and newest_common_step([]) is None


def test_each_node_job_and_run_has_its_own_folder(tmp_path: Path) -> None:
    one = node_memory_ckpt_dir(tmp_path, tmp_path / "run_a", "12", "a0-n1")
    assert len({one, node_memory_ckpt_dir(tmp_path, tmp_path / "run_a", "12", "a0-n2"),
                node_memory_ckpt_dir(tmp_path, tmp_path / "run_a", "12", "a1-n1"),
                node_memory_ckpt_dir(tmp_path, tmp_path / "run_a", "13", "a0-n1"),
                node_memory_ckpt_dir(tmp_path, tmp_path / "run_b", "12", "a0-n1")}) == 5  # fmt: skip
    assert one.parent == tmp_path / f"orchestrator-{os.getuid()}"
    assert one.name.startswith(job_memory_ckpt_prefix(tmp_path / "run_a", "12"))
    for bad in ("../x", "a/b", "", "n 1"):
        with pytest.raises(ValueError, match="memory key"):
            node_memory_ckpt_dir(tmp_path, tmp_path / "run_a", "12", bad)


def test_each_rank_is_copied_to_the_same_local_rank_half_the_nodes_away() -> None:
    # 3 nodes of 2 ranks: 0,1 | 2,3 | 4,5: half of 3 is the next node
    assert [replica_peer(r, 6, 2) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [replica_owner(r, 6, 2) for r in range(6)] == [4, 5, 0, 1, 2, 3]
    # 4 nodes of 2 ranks: node 0's copies on node 2 and back, node 1's on node 3 and back
    assert [replica_peer(r, 8, 2) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [replica_owner(r, 8, 2) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    # any run of neighbours up to half the nodes (a rack) lost together leaves every rank's file
    # somewhere; one more, and some rank's file and its copy are both gone
    for nodes in (5, 16):
        for first in range(nodes):
            for run in (nodes // 2, nodes // 2 + 1):
                lost = {(first + k) % nodes for k in range(run)}
                kept = all(replica_peer(r, nodes, 1) not in lost for r in lost)
                assert kept == (run <= nodes // 2), (nodes, sorted(lost))
    assert replica_peer(1, 2, 2) is None and replica_owner(0, 4, 4) is None  # one node: nowhere else
    assert replica_peer(0, 5, 2) is None and replica_peer(0, 4, 0) is None  # no whole nodes: no guess


def test_a_step_counts_where_every_ranks_file_is_on_some_node_and_the_missing_ones_are_sent() -> None:
    # After a swap: rank 0 on the old node 1 (holds owner 1 own, owner 0 its copy), rank 1 a spare.
    survivor = {1: [8, 4], 0: [8, 4]}
    spare: dict[int, list[int]] = {}
    assert newest_step_held([survivor, spare], 2) == 8
    assert transfers([survivor, spare], 8) == [(0, 1)]  # rank 0's node has rank 1's file
    assert transfers([{0: [8], 1: [8]}, {1: [8], 0: [8]}], 8) == []  # in place: each has its own
    assert newest_step_held([{0: [8, 4]}, {1: [4]}], 2) == 4  # rank 1 was writing 8
    assert newest_step_held([{0: [8]}, {0: [8]}], 2) is None  # rank 1's file is nowhere
    assert newest_step_held([], 2) is None


def test_a_node_folder_lists_its_own_ranks_and_its_copies_by_owner(tmp_path: Path) -> None:
    for world, rank, step in ((4, 2, 4), (4, 2, 8), (4, 0, 8), (2, 0, 8)):
        memory_ckpt_file(tmp_path, world, rank, step).write_bytes(b"x")
    (tmp_path / f".{memory_ckpt_file(tmp_path, 4, 0, 12).name}.1.tmp").write_bytes(b"torn")
    assert memory_ckpt_holdings(tmp_path, 4) == {2: [8, 4], 0: [8]}
    assert memory_ckpt_holdings(tmp_path / "missing", 4) == {}


def test_a_temp_file_of_a_writer_that_is_gone_is_removed_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    """A rank killed mid-save or mid-copy leaves ``.<name>.<pid>.tmp``, up to a shard's size of memory in
    a folder a restart in place keeps."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    name = memory_ckpt_file(tmp_path, 2, 0, 3).name
    torn, live = tmp_path / f".{name}.{gone.pid}.tmp", tmp_path / f".{name}.{os.getpid()}.tmp"
    whole = memory_ckpt_file(tmp_path, 2, 0, 2)
    for path in (torn, live, whole):
        path.write_bytes(b"x")
    remove_torn_files(tmp_path)
    assert not torn.exists() and live.exists() and whole.exists()
    remove_torn_files(tmp_path / "missing")  # no folder yet: nothing to do
