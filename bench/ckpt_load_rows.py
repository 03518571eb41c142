"""The sharded-load goal rows of bench/results.md (issue 44: a load >= 0.8x a plain read of the same
bytes, cold and warm; a whole resume, its integrity check included, >= 0.6x), from the pairs
ckpt_save_probe.py measures (``bench_ckpt_load.save_probe``)."""

from __future__ import annotations

LOAD_ITEM = (
    "sharded load, base: train/'s load (load_state) vs readinto the same local shards, page cache dropped "
    "before each (a resume on another node)"
)
WARM_ITEM = (
    "sharded load, base, page cache warm: train/'s load vs readinto the same local shards, same processes"
)
RESUME_ITEM = (
    "sharded resume, base, page cache dropped: what a resumed train/ does (rank 0 checks the marker and "
    "every file's sha256 but the shards', every rank its own shards' (checked_choice), then the load) vs "
    "readinto the same local shards"
)


def load_rows(p: dict, note: str = "") -> list[dict]:
    """The sharded-load goal rows (issue 44: load >= 0.8x a plain read cold and warm, resume >= 0.6x)
    from ckpt_save_probe.py's pairs (``save_probe``); ``note`` ends each goal row's measurement (when,
    how, the load average)."""
    cold, warm, rc = p.get("load_cold"), p.get("load_warm"), p.get("resume_cold")
    rows: list[dict] = []
    why = (
        "each rank reads its own byte ranges straight into the parameters and the optimizer state "
        "through the load plan it wrote at save time (orchestrator/rank/shard_plan.py: no DCP planning, "
        "no state-dict round trips, one all_reduce)"
    )
    if cold:
        rows.append(
            {
                "item": f"{LOAD_ITEM}, {p['pairs']} interleaved pairs",
                "goal": ">= 0.8x a plain read of the same bytes (median of pair ratios)",
                "measured": f"load {cold['cold_load_median_s']:.2f} s vs read {cold['cold_raw_read_median_s']:.2f} s "
                f"(pair ratios {min(cold['pair_ratios']):.2f}-{max(cold['pair_ratios']):.2f}); {why}{note}",
                "ratio": f"{cold['ratio_median']:.2f}x of read",
                "met": cold["ratio_median"] >= 0.8,
            }
        )
    if warm:
        rows.append(
            {
                "item": f"{WARM_ITEM}, {p['pairs']} interleaved pairs",
                "goal": ">= 0.8x a plain read of the same bytes (median of pair ratios)",
                "measured": f"load {warm['load_median_s']:.3f} s vs read {warm['raw_read_median_s']:.3f} s "
                f"(pair ratios {min(warm['pair_ratios']):.2f}-{max(warm['pair_ratios']):.2f}){note}",
                "ratio": f"{warm['ratio_median']:.2f}x of read",
                "met": warm["ratio_median"] >= 0.8,
            }
        )
    if rc:
        ph = p.get("resume_phases_median_s") or {}
        split = (
            f" = pick {ph['pick']:.2f} + shards' sha256 {ph['check']:.2f} + load "
            f"{rc['cold_resume_median_s'] - ph['pick'] - ph['check']:.2f} s (medians)"
            if {"pick", "check"} <= set(ph)
            else ""
        )
        rows.append(
            {
                "item": f"{RESUME_ITEM}, {p['pairs']} interleaved pairs",
                "goal": ">= 0.6x a plain read of the same bytes (median of pair ratios)",
                "measured": f"resume {rc['cold_resume_median_s']:.2f} s{split} vs read "
                f"{rc['cold_raw_read_median_s']:.2f} s (pair ratios {min(rc['pair_ratios']):.2f}-{max(rc['pair_ratios']):.2f}); each rank hashes the "
                "shards it reads, all ranks at once, with the kernel reading ahead (was: rank 0 hashed every file)"
                + note,
                "ratio": f"{rc['ratio_median']:.2f}x of read",
                "met": rc["ratio_median"] >= 0.6,
            }
        )
    vc, vw = p.get("load_vs_stock_cold"), p.get("load_vs_stock_warm")
    if vc and vw:
        reads = p.get("direct_reads") or {}
        rows.append(
            {
                "item": "sharded load, base: through each rank's load plan (issue 44) vs DCP's stock load "
                "(FileSystemReader, planner, Accelerate's state-dict round trips), same processes, interleaved",
                "goal": "report",
                "measured": f"cold {vc['cold_load_median_s']:.2f} s vs {vc['cold_load_before_median_s']:.2f} s "
                f"(pair ratios {min(vc['pair_ratios']):.2f}-{max(vc['pair_ratios']):.2f}); warm "
                f"{vw['load_median_s']:.3f} s vs {vw['load_before_median_s']:.3f} s"
                + (
                    f"; {reads['planned']} tensors a rank read through its plan, {reads['direct']} through "
                    f"DCP's planner"
                    + (f" (plan not used: {reads['why_not']})" if reads.get("why_not") else "")
                    if reads
                    else ""
                ),
                "ratio": f"{1 / vc['ratio_median']:.2f}x faster cold, {1 / vw['ratio_median']:.2f}x warm",
                "met": None,
            }
        )
    return rows
