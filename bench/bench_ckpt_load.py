"""Checkpoint save AND load of the ``base`` preset (~128M parameters, 2 ranks, FSDP2 full_shard):
sharded (SHARDED_STATE_DICT, DCP, every rank writes its shard) against a gathered full state dict
(``--state-dict full``: FULL_STATE_DICT, rank 0 writes pytorch_model_fsdp.bin + optimizer.bin), and
both against the disk: a Python write + fsync of the same byte count, and a plain read of the
checkpoint's files.

Per repetition (order flipped every repetition):

* save: ``accelerate launch --config_file <render --strategy full_shard --wrap-cls TransformerBlock
  [--state-dict full]> train/train.py --preset base --max-steps 1 --ckpt-every 1`` (a fresh run dir);
  the time is train's own ``checkpoint step 1 saved in X s`` (accelerator.save_state into a temp
  folder, barrier, fsync of every file, marker, rename: train/checkpointing.py ``save``), bytes from
  COMPLETE.json;
* load: the same command again on the same run dir (``--resume auto``; max steps reached, so no step
  and no new save); the time is ``load_s`` from loaded.json (accelerator.load_state);
* raw write: write + fsync of the same byte count (8 MiB chunks, one file) on the same disk;
* raw read: reading every file of the checkpoint just written (page cache warm, as the load found it).

Tiny batches (1 x 16 tokens, one eval batch) keep the compute out of the way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
TRAIN_ARGS = [
    "--preset",
    "base",
    "--data",
    "synthetic",
    "--max-steps",
    "1",
    "--ckpt-every",
    "1",
    "--keep-last",
    "2",
    "--log-every",
    "1000",
    "--batch-size",
    "1",
    "--seq-len",
    "16",
    "--eval-batches",
    "1",
    "--warmup-steps",
    "1",
]


def render(out: Path, env: dict, state_dict: str) -> Path:
    subprocess.run(
        [
            PY,
            "-m",
            "orchestrator",
            "render",
            "--profile",
            "local",
            "--nodes",
            "1",
            "--procs-per-node",
            "2",
            "--strategy",
            "full_shard",
            "--wrap-cls",
            "TransformerBlock",
            "--state-dict",
            state_dict,
            "--out",
            str(out),
            "--",
            "train/train.py",
        ],
        env=env,
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return next(out.glob("accelerate_config*.yaml"))


def launch(cfg: Path, run_dir: Path, env: dict, port: int) -> str:
    acc = shutil.which("accelerate") or "accelerate"
    env = dict(env, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    cmd = [
        acc,
        "launch",
        "--config_file",
        str(cfg),
        "--main_process_port",
        str(port),
        "train/train.py",
        *TRAIN_ARGS,
        "--run-dir",
        str(run_dir),
    ]
    res = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr[-3000:]}")
    return res.stdout


def raw_read(folder: Path, chunk: int = 8 << 20) -> float:
    t = time.perf_counter()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while f.read(chunk):
                    pass
    return time.perf_counter() - t


def one(kind: str, cfg: Path, run_dir: Path, env: dict, port, load: bool = True) -> dict:
    out = launch(cfg, run_dir, env, port())
    m = re.search(r"saved in ([\d.]+)s", out)
    if not m:
        raise RuntimeError(f"{kind}: no 'saved in' line: {out[-2000:]}")
    folder = run_dir / "checkpoints" / "step_00000001"
    marker = json.loads((folder / "COMPLETE.json").read_text())
    nbytes = sum(marker["files"].values())
    load_s = None
    if load:
        launch(cfg, run_dir, env, port())
        load_s = float(json.loads((run_dir / "loaded.json").read_text())["load_s"])
    read_s = raw_read(folder)
    split = {k: float(v) for k, v in re.findall(r"(write|finalize) ([\d.]+)s", out)}
    # The marker's digests, serial (as before issue 16) against the threads finalize now uses,
    # interleaved on the same files (page cache warm, as finalize found them).
    from orchestrator.checkpoint_files import file_digest, file_digests

    rels = list(marker["files"])
    t = time.perf_counter()
    serial = {rel: file_digest(folder / rel) for rel in rels}
    digest_serial_s = time.perf_counter() - t
    t = time.perf_counter()
    parallel = file_digests(folder, rels)
    digest_parallel_s = time.perf_counter() - t
    assert serial == parallel == marker.get("sha256", serial)
    return {
        "save_split_s": split,
        "digest_serial_s": round(digest_serial_s, 3),
        "digest_parallel_s": round(digest_parallel_s, 3),
        "save_s": float(m.group(1)),
        "load_s": load_s,
        "bytes": nbytes,
        "raw_read_s": read_s,
        "files": len(marker["files"]),
    }


def raw_write_per_rank(folder: Path, nbytes: int, ranks: int = 2, chunk: int = 8 << 20) -> float:
    """The disk doing what the sharded save asks of it: ``ranks`` writers at once, each writing and
    fsyncing its own share. One stream (``raw_write``) is what the disk does best, not what a 2-rank
    DCP save does; measured here, 1 and 2 concurrent writers of the same bytes differed up to 2x."""
    from concurrent.futures import ThreadPoolExecutor

    buf = os.urandom(chunk)

    def write_share(i: int) -> None:
        fd = os.open(folder / f"raw_rank{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes // ranks
            while left > 0:
                left -= os.write(fd, buf[: min(len(buf), left)])  # releases the GIL: writers overlap
            os.fsync(fd)
        finally:
            os.close(fd)

    started = time.perf_counter()
    with ThreadPoolExecutor(ranks) as pool:
        list(pool.map(write_share, range(ranks)))
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    wall = time.perf_counter() - started
    for i in range(ranks):
        (folder / f"raw_rank{i}.bin").unlink()
    return wall


def dcp_vs_raw(tmp: Path, env: dict, port: int, reps: int = 5) -> dict:
    """ckpt_dcp_probe.py under torchrun (2 ranks): DCP's save of the FSDP2 base state against a raw
    write + fsync of the same local shards, same processes, interleaved."""
    folder = tmp / "dcp_probe"
    cmd = [
        PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
        str(REPO / "bench" / "ckpt_dcp_probe.py"), str(folder), str(reps),
    ]  # fmt: skip
    res = subprocess.run(
        cmd, env=dict(env, OMP_NUM_THREADS="1"), cwd=REPO, capture_output=True, text=True, timeout=900
    )
    shutil.rmtree(folder, ignore_errors=True)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not rows:
        return {"error": f"ckpt_dcp_probe.py failed ({res.returncode}): {res.stderr[-1500:]}"}
    ratios = [r["raw_s"] / r["dcp_s"] for r in rows]
    return {
        "reps": len(rows),
        "bytes": rows[0]["bytes"],
        "dcp_all_s": [round(r["dcp_s"], 3) for r in rows],
        "raw_all_s": [round(r["raw_s"], 3) for r in rows],
        "dcp_median_s": round(statistics.median(r["dcp_s"] for r in rows), 3),
        "raw_median_s": round(statistics.median(r["raw_s"] for r in rows), 3),
        "pair_ratios": [round(x, 3) for x in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
    }


def bench_ckpt_base(
    tmp: Path, reps: int, env: dict, free_port, raw_write, log=print, full_load: bool = True
) -> dict:
    """``full_load=False`` (``--quick``) skips loading the full-state-dict checkpoint (one launch less)."""
    tmp.mkdir(parents=True, exist_ok=True)
    cfgs = {
        "sharded": render(tmp / "cfg_sharded", env, "sharded"),
        "full": render(tmp / "cfg_full", env, "full"),
    }
    runs: dict[str, list[dict]] = {"sharded": [], "full": []}
    raw_w: list[float] = []
    raw_ranks: list[float] = []
    n = 0
    for r in range(reps):
        order = ["sharded", "full"] if r % 2 == 0 else ["full", "sharded"]
        for kind in order:
            n += 1
            log(f"checkpoints (base): {kind} save + load, repetition {r + 1}")
            run_dir = tmp / f"run{n}_{kind}"
            runs[kind].append(
                one(kind, cfgs[kind], run_dir, env, free_port, load=kind == "sharded" or full_load)
            )
            shutil.rmtree(run_dir, ignore_errors=True)  # 1.5 GB each
        raw_w.append(raw_write(tmp / "raw.bin", runs["sharded"][-1]["bytes"]))
        raw_ranks.append(raw_write_per_rank(tmp, runs["sharded"][-1]["bytes"]))

    def med(xs):
        return statistics.median(xs)

    log("checkpoints (base): DCP save vs raw write of the same shards, same processes (ckpt_dcp_probe.py)")
    probe = dcp_vs_raw(tmp, env, free_port(), reps=3 if reps < 2 else 5)
    res: dict = {
        "dcp_vs_raw_same_bytes": probe,
        "preset": "base",
        "strategy": "full_shard (FSDP2, wrap TransformerBlock), 2 ranks, CPU",
        "reps": reps,
        "train_args": TRAIN_ARGS,
    }
    nbytes = med([x["bytes"] for x in runs["sharded"]])
    raw_s = med(raw_w)
    res["raw_write_fsync_median_s"] = round(raw_s, 3)
    res["raw_write_fsync_all_s"] = [round(x, 3) for x in raw_w]
    res["raw_write_MBps"] = round(nbytes / raw_s / 1e6, 1)
    raw_ranks_s = med(raw_ranks)
    res["raw_write_2_writers_median_s"] = round(raw_ranks_s, 3)
    res["raw_write_2_writers_all_s"] = [round(x, 3) for x in raw_ranks]
    res["raw_write_2_writers_MBps"] = round(nbytes / raw_ranks_s / 1e6, 1)
    for kind, rows in runs.items():
        b = med([x["bytes"] for x in rows])
        s, rd = med([x["save_s"] for x in rows]), med([x["raw_read_s"] for x in rows])
        loads = [x["load_s"] for x in rows if x["load_s"] is not None]
        ld = med(loads) if loads else None
        res[kind] = {
            "bytes": int(b),
            "files": rows[0]["files"],
            "save_median_s": round(s, 3),
            "save_all_s": [x["save_s"] for x in rows],
            "save_MBps": round(b / s / 1e6, 1),
            "load_median_s": round(ld, 3) if ld else None,
            "load_all_s": [round(x, 3) for x in loads],
            "load_MBps": round(b / ld / 1e6, 1) if ld else None,
            "raw_read_median_s": round(rd, 3),
            "raw_read_MBps": round(b / rd / 1e6, 1),
            "save_vs_raw_write": round((b / s) / (nbytes / raw_s), 3),
            "save_vs_raw_write_2_writers": round((b / s) / (nbytes / raw_ranks_s), 3),
            "save_split_median_s": {
                k: round(med([x["save_split_s"][k] for x in rows if k in x.get("save_split_s", {})]), 3)
                for k in ("write", "finalize")
                if any(k in x.get("save_split_s", {}) for x in rows)
            },
            "digest_serial_median_s": round(med([x["digest_serial_s"] for x in rows]), 3),
            "digest_parallel_median_s": round(med([x["digest_parallel_s"] for x in rows]), 3),
        }
    return res


def goal_rows(c: dict) -> list[dict]:
    s, f = c["sharded"], c["full"]
    return [
        {
            "item": f"sharded save, base ({s['bytes'] / 1e9:.2f} GB) vs raw write+fsync (2 writers at once, as the 2 ranks)",
            "goal": ">= 0.5x raw disk bandwidth",
            "measured": f"{s['save_median_s']:.2f} s = {s['save_MBps']} MB/s vs raw 2 writers "
            f"{c['raw_write_2_writers_median_s']:.2f} s = {c['raw_write_2_writers_MBps']} MB/s "
            f"(1 stream: {c['raw_write_fsync_median_s']:.2f} s = {c['raw_write_MBps']} MB/s)",
            "ratio": f"{s['save_vs_raw_write_2_writers']:.2f}x of disk (1 stream: {s['save_vs_raw_write']:.2f}x)",
            "met": s["save_vs_raw_write_2_writers"] >= 0.5,
        },
        *(
            [
                {
                    "item": "DCP save of the FSDP2 base state (model + AdamW, 2 ranks) vs os.write + fsync of the same "
                    "local shards, same processes, interleaved (ckpt_dcp_probe.py)",
                    "goal": "report (DCP's writer against the disk under the same conditions)",
                    "measured": f"DCP {p['dcp_median_s']:.2f} s vs raw {p['raw_median_s']:.2f} s "
                    f"({p['bytes'] / 1e9:.2f} GB; {p['reps']} pairs, raw/DCP per pair "
                    f"{min(p['pair_ratios']):.2f}-{max(p['pair_ratios']):.2f})",
                    "ratio": f"{p['ratio_median']:.2f}x of raw (median of pair ratios)",
                    "met": None,
                }
            ]
            if "ratio_median" in (p := c.get("dcp_vs_raw_same_bytes", {}))
            else []
        ),
        {
            "item": "sharded save, base: where the time goes; the marker's sha256 digests serial vs threaded",
            "goal": "report",
            "measured": "save = "
            + " + ".join(f"{k} {v:.2f} s" for k, v in s.get("save_split_median_s", {}).items())
            + f" (write: every rank's DCP shards; finalize: rank 0's fsyncs, sha256 of every file, marker, rename); "
            f"digests alone on the same files: serial {s['digest_serial_median_s']:.2f} s, threaded "
            f"{s['digest_parallel_median_s']:.2f} s",
            "ratio": f"threaded digests {s['digest_serial_median_s'] / s['digest_parallel_median_s']:.2f}x faster",
            "met": None,
        },
        {
            "item": "sharded load, base vs reading its files",
            "goal": ">= 0.5x a plain read of the same files",
            "measured": f"{s['load_median_s']:.2f} s = {s['load_MBps']} MB/s vs raw read {s['raw_read_median_s']:.2f} s = {s['raw_read_MBps']} MB/s (page cache warm)",
            "ratio": f"{s['load_MBps'] / s['raw_read_MBps']:.2f}x of read",
            "met": s["load_MBps"] / s["raw_read_MBps"] >= 0.5,
        },
        {
            "item": f"full state dict save / load, base ({f['bytes'] / 1e9:.2f} GB, rank 0 writes)",
            "goal": "report (vs sharded)",
            "measured": f"save {f['save_median_s']:.2f} s = {f['save_MBps']} MB/s, "
            + (
                f"load {f['load_median_s']:.2f} s = {f['load_MBps']} MB/s"
                if f["load_median_s"]
                else "load not measured (--quick)"
            ),
            "ratio": f"sharded save {f['save_median_s'] / s['save_median_s']:.2f}x faster"
            + (f", load {f['load_median_s'] / s['load_median_s']:.2f}x faster" if f["load_median_s"] else ""),
            "met": None,
        },
    ]


if __name__ == "__main__":  # pragma: no cover - manual run
    sys.path.insert(0, str(REPO / "bench"))
    from run import BASE_ENV, free_port, raw_write_fsync

    print(
        json.dumps(
            bench_ckpt_base(
                Path(os.environ.get("TMPDIR", "/tmp")) / "ckpt_base", 1, BASE_ENV, free_port, raw_write_fsync
            ),
            indent=1,
        )
    )
