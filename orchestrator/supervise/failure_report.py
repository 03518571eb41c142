"""Why a job failed, in words: the failing node and rank, its first error lines, and where to look.

A failed job leaves its explanation in files nobody reads by default: the node logs
(``logs/attempt_<A>/node_<N>.log``, every rank's output prefixed ``[default<L>]:`` by torchrun's
``--tee``), the training's ``exit_status.json`` (self-check, restore mismatch), and the scheduler's
own stdout/stderr (``Scheduler.log_files``: where an error raised before or around the launch
lands, e.g. a full disk or a bad ``network_interface``). :func:`explain_failure` reads them and
names the *root* failure: when one rank raises, its peers die of "Connection closed by peer" and
SIGTERM a moment later, and those consequences must not hide the cause.

``status``, ``submit --wait`` / ``wait`` and the registry's ``end_reason`` all show
:meth:`Explanation.summary` (:mod:`orchestrator.core.failure_report`); a local job's node 0 writes it. Standard library only: the CLI imports it without torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.contract.run_dir import (
    EXIT_REQUEUE,
    NODE_EXIT_RE,
    attempt_dirs,
    node_logs,
    read_exit_status,
)

#: Only the end of a huge log is read: tracebacks are written last.
MAX_READ_BYTES = 4 << 20
#: Error lines quoted per explanation.
MAX_QUOTED = 3

_LOCAL_PREFIX = re.compile(r"^\[default(\d+)\]:")
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")
#: The last line of a traceback: ``ValueError: boom``, ``torch.OutOfMemoryError: ...``, ``KeyboardInterrupt``.
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?::\s.*|:?)$")
#: Lines that are an error wherever they appear, with or without a traceback.
_ERROR_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|SELF-CHECK FAILED|^\[rank \d+\]\s+- |^error: |NCCL error|"
    r"ncclInternalError|ncclSystemError|CUDA out of memory|out of memory|Segmentation fault|"
    r"core dumped|Bus error",
)
#: What a rank dies of when *another* rank failed: consequences, never the cause.
_CONSEQUENCE = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crash|Broken pipe|"
    r"Signal 15|SIGTERM|ChildFailedError|training exited with code|while no training runs|"
    r"closing signal|Sending process|Socket Timeout|stopped because node|"
    r"Timed out waiting|failed to recv|read error",
    re.IGNORECASE,
)
_SCHEDULER_NODE = re.compile(r"_(\d+)_log\.(?:err|out)$")


@dataclass(frozen=True)
class Explanation:
    """The root failure of one job attempt."""

    job_id: str
    node: int | None
    rank: int | None
    lines: tuple[str, ...]
    """The first error lines of that rank (exception line first)."""
    source: str
    """The file they were read from."""
    exit_codes: dict[int, int] = field(default_factory=dict)

    @property
    def logs_command(self) -> str:
        cmd = f"orchestrator logs {self.job_id}"
        if self.node is not None:
            cmd += f" --node {self.node}"
        if self.rank is not None:
            cmd += f" --rank {self.rank}"
        return cmd

    @property
    def where(self) -> str:
        parts = []
        if self.node is not None:
            parts.append(f"node {self.node}")
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        return " ".join(parts) or "the job"

    def summary(self) -> str:
        """One line: ``node 1 rank 3 failed: ValueError: boom; see `orchestrator logs J --node 1 --rank 3```."""
        what = self.lines[0] if self.lines else "no error line found"
        if "SELF-CHECK FAILED" in what and len(self.lines) > 1:
            what += " " + self.lines[1].split("]", 1)[-1].strip()  # the header alone says nothing
        if len(what) > 300:
            what = what[:297] + "..."
        return f"{self.where} failed: {what}; see `{self.logs_command}`"

    def text(self, indent: str = "  ") -> str:
        """Several lines, for ``--wait``: where, the quoted error lines, the command."""
        out = [f"{indent}{self.where} failed" + (f" (read from {self.source})" if self.source else "") + ":"]
        out += [f"{indent}  | {line}" for line in self.lines] or [f"{indent}  | (no error line found)"]
        out.append(f"{indent}see: {self.logs_command}")
        return "\n".join(out)


@dataclass
class _RankErrors:
    first_line: int
    lines: list[str] = field(default_factory=list)
    consequence_only: bool = True

    def add(self, text: str) -> None:
        text = text.strip()
        if not text or text in self.lines:
            return
        if not _CONSEQUENCE.search(text):
            if self.consequence_only:
                self.lines = [text]  # the cause goes first; consequences found earlier go
                self.consequence_only = False
                return
        elif not self.consequence_only:
            return
        self.lines.append(text)


def _read_tail(path: Path) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - MAX_READ_BYTES))
            data = fh.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()


def scan_errors(lines: Iterable[str]) -> dict[int | None, _RankErrors]:
    """Error lines per local rank (``None``: the node's own, unprefixed output)."""
    found: dict[int | None, _RankErrors] = {}
    in_traceback: dict[int | None, bool] = {}
    for number, raw in enumerate(lines):
        m = _LOCAL_PREFIX.match(raw)
        local: int | None = int(m.group(1)) if m else None
        text = raw[m.end() :] if m else raw
        r = _RANK_PREFIX.match(text)
        if r:
            text = text[r.end() :]
        stripped = text.rstrip()
        if stripped.startswith("Traceback (most recent call last)"):
            in_traceback[local] = True
            continue
        is_error = False
        if in_traceback.get(local):
            if stripped.startswith((" ", "\t")) or not stripped or set(stripped) <= set("^~ "):
                continue
            in_traceback[local] = False
            if stripped.startswith(("During handling", "The above exception")):
                continue
            is_error = bool(_EXCEPTION_LINE.match(stripped))
        if (
            not is_error
            and _ERROR_TEXT.search(stripped)
            and not stripped.startswith("[orchestrator node] exec:")
        ):
            is_error = True
        if is_error:
            entry = found.setdefault(local, _RankErrors(first_line=number))
            entry.add(stripped)
    return found


def _exit_codes(attempt_path: Path) -> dict[int, int]:
    codes: dict[int, int] = {}
    try:
        entries = list(attempt_path.iterdir())
    except OSError:
        return codes
    for entry in entries:
        m = NODE_EXIT_RE.match(entry.name)
        if m:
            try:
                codes[int(m.group(1))] = int(entry.read_text().strip() or 1)
            except (OSError, ValueError):
                continue
    return codes


def _candidates(
    attempt_path: Path, procs_per_node: int, codes: dict[int, int]
) -> list[tuple[int, int, int | None, _RankErrors, Path]]:
    """``(priority, node, rank, errors, path)``; lower priority is more likely the cause."""
    out: list[tuple[int, int, int | None, _RankErrors, Path]] = []
    for node, path in node_logs(attempt_path):
        for local, errors in scan_errors(_read_tail(path)).items():
            rank = None if local is None else node * procs_per_node + local
            failed_node = codes.get(node, 1) not in (0, EXIT_REQUEUE)
            priority = (0 if not errors.consequence_only else 2) + (0 if failed_node else 1)
            if local is None:
                priority += 1  # a rank's own error says more than its launcher's summary
            out.append((priority, node, rank, errors, path))
    out.sort(key=lambda c: (c[0], c[3].first_line, c[1]))
    return out


def explain_failure(
    run_dir: Path | str,
    job_id: str,
    *,
    procs_per_node: int = 1,
    scheduler_logs: Sequence[Path] = (),
) -> Explanation | None:
    """The root failure of the newest attempt of ``run_dir``; None when there is nothing to say."""
    run_dir = Path(run_dir)
    attempts = attempt_dirs(run_dir)
    codes: dict[int, int] = {}
    if attempts:
        attempt_path = attempts[-1][1]
        codes = _exit_codes(attempt_path)
        candidates = _candidates(attempt_path, max(1, procs_per_node), codes)
        if candidates and not candidates[0][3].consequence_only:
            _, node, rank, errors, path = candidates[0]
            lines = tuple(errors.lines[:MAX_QUOTED])
            return Explanation(job_id, node, rank, lines, str(path), codes)
        status = read_exit_status(run_dir)
        if status and status.get("code") not in (None, 0, EXIT_REQUEUE):
            problems = [str(p) for p in status.get("problems") or []]
            lines = (f"exit {status.get('code')}: {status.get('reason')}", *problems)
            bad = [n for n, c in sorted(codes.items()) if c not in (0, EXIT_REQUEUE)]
            return Explanation(
                job_id, bad[0] if bad else None, None, tuple(lines[:MAX_QUOTED]), str(run_dir), codes
            )
    # Errors raised around the launch (set-up, the interpreter, a full disk) reach only the scheduler's files.
    for path in scheduler_logs:
        found = scan_errors(_read_tail(path)).get(None)
        if found is not None and not found.consequence_only:
            m = _SCHEDULER_NODE.search(path.name)
            return Explanation(
                job_id,
                int(m.group(1)) if m else None,
                None,
                tuple(found.lines[:MAX_QUOTED]),
                str(path),
                codes,
            )
    if attempts:
        candidates = _candidates(attempts[-1][1], max(1, procs_per_node), codes)
        if candidates:
            _, node, rank, errors, path = candidates[0]
            return Explanation(job_id, node, rank, tuple(errors.lines[:MAX_QUOTED]), str(path), codes)
        bad = [n for n, c in sorted(codes.items()) if c not in (0, EXIT_REQUEUE)]
        if bad:
            return Explanation(
                job_id, bad[0], None, (f"exit code {codes[bad[0]]}, no error line in its log",), "", codes
            )
    return None
