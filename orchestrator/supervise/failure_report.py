"""Why a job failed, in words: the failing node and rank, its first error lines, and where to look.

A failed job leaves its explanation in files nobody reads by default: the node logs
(``logs/attempt_<A>/node_<N>.log``, every rank's output prefixed ``[default<L>]:`` by torchrun's
``--tee``), the training's ``exit_status.json`` (self-check, restore mismatch), and the scheduler's
own stdout/stderr (``Scheduler.log_files``: where an error raised before or around the launch
lands, e.g. a full disk or a bad ``network_interface``). :func:`explain_failure` reads them and
names the *root* failure: when one rank raises, its peers die of "Connection closed by peer" and
SIGTERM a moment later, and those consequences must not hide the cause.

``status``, ``submit --wait`` / ``wait`` and the registry's ``end_reason`` all show
:meth:`Explanation.summary` (:mod:`orchestrator.runner.failure_reasons`); a local job's node 0 writes it. Standard library only: the CLI imports it without torch.
An attempt the hang watchdog ended is explained by its ``hang.json``, whatever its ranks died of
(the watchdog's SIGKILL): one reason in ``wait``, ``status`` and the notification.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from orchestrator.contract.run_dir import (
    EXIT_REQUEUE,
    HANG_REPORT_FILE,
    NODE_EXIT_RE,
    attempt_dirs,
    hang_dir,
    node_logs,
    read_exit_status,
    read_json,
)
from orchestrator.supervise.disk_full import DiskFull, disk_full, read_tail

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
    r"core dumped|Bus error|"
    # Python's own one-line failures, which never reach a traceback: `python -m` of a module that is
    # not there (a node environment without a package), a script that is not there, a missing command.
    r"Error while finding module specification|can't open file|No module named|: command not found",
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
#: The direct launcher's line for the first rank of its node that ended badly
#: (``orchestrator/node/direct_launch.py``; signals as 128 + N, as a shell reports them).
_LAUNCHER_EXIT = re.compile(r"^\[orchestrator launch\] rank (\d+) \(local (\d+)\) exited with code (-?\d+)")
#: torchrun's summary of its first failed child: ``rank : 1 (local_rank: 1)``, ``exitcode : -9``.
_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: (\d+)\)")
_TORCHRUN_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
#: The heading of torchrun's own pick among them; its "Failures:" list (the peers it then stopped,
#: by SIGTERM) comes first in the summary.
_TORCHRUN_ROOT = re.compile(r"^\s*Root Cause \(first observed failure\):")
#: The signal a supervisor sends a rank's peers once one failed: a death by it is a consequence.
_SIGTERM = 15
#: A node log's line saying the job itself ended that node's training (node/entry.py's words): its
#: ranks' deaths are what the job did, never a fault's cause.
_STOPPED_BY_THE_JOB = re.compile(
    r"^\[orchestrator node\] (?:stopped because node \d+ failed|training still running .* after SIGTERM: killing it)"
)


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
    disk: DiskFull | None = None
    """Set when a log of the attempt says the disk is full (or the run directory's filesystem is):
    the cause of whatever the rank raised (a full disk makes ``torch.save`` raise C++'s
    ``basic_ios::clear: iostream error``, which names no disk)."""
    hang: bool = False
    """The hang watchdog ended the attempt: ``lines`` is its reason (``hang.json``), said as it is."""

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
        if self.hang:
            return self.lines[0]
        what = self.lines[0] if self.lines else "no error line found"
        if "SELF-CHECK FAILED" in what and len(self.lines) > 1:
            what += " " + self.lines[1].split("]", 1)[-1].strip()  # the header alone says nothing
        if self.disk is not None:
            what = self.disk.before(what if self.lines else "")
        if len(what) > 300:
            what = what[:297] + "..."
        return f"{self.where} failed: {what}; see `{self.logs_command}`"

    def text(self, indent: str = "  ") -> str:
        """Several lines, for ``--wait``: where, the quoted error lines, the command."""
        if self.hang:
            return f"{indent}{self.lines[0]}\n{indent}see: {self.logs_command}"
        out = [f"{indent}{self.where} failed" + (f" (read from {self.source})" if self.source else "") + ":"]
        if self.disk is not None:
            out.append(f"{indent}  | {self.disk}")
        out += [f"{indent}  | {line}" for line in self.lines] or (
            [] if self.disk else [f"{indent}  | (no error line found)"]
        )
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


@dataclass(frozen=True)
class RankDeath:
    """A rank that ended badly, as its node's launcher saw it (the first one on that node)."""

    node: int
    rank: int
    code: int
    """The exit code; a death by signal N is 128 + N."""
    line: int
    """Its line number in the node log: the launcher notes the first failure before any of its
    consequences."""

    @property
    def signal(self) -> int | None:
        return self.code - 128 if 128 < self.code < 160 else None

    def describe(self) -> str:
        sig = self.signal
        if sig is None:
            return f"rank {self.rank} exited first, with code {self.code}"
        import signal as _signal

        try:
            name = _signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        why = {
            "SIGKILL": "killed from outside the job (kill -9, or the kernel's out-of-memory killer)",
            "SIGSEGV": "a crash in native code",
            "SIGBUS": "a bus error (often a full /dev/shm)",
            "SIGABRT": "aborted by native code",
        }.get(name, "killed by a signal")
        return f"rank {self.rank} died of {name} (exit code {self.code}): {why}"


def rank_deaths(lines: Iterable[str], node: int) -> list[RankDeath]:
    """The launcher's record of the ranks of ``node`` that ended badly, the first one first (direct
    launcher), or torchrun's root-cause rank first: torchrun lists the peers it stopped before it."""
    out: list[RankDeath] = []
    pending: tuple[int, int] | None = None
    root: RankDeath | None = None
    in_root = False
    for number, raw in enumerate(lines):
        if _TORCHRUN_ROOT.match(raw):
            in_root = True
            continue
        m = _LAUNCHER_EXIT.match(raw)
        if m:
            code = int(m.group(3))
            if code < 0:
                code = 128 - code
            if code not in (0, EXIT_REQUEUE):
                out.append(RankDeath(node, int(m.group(1)), code, number))
            continue
        r = _TORCHRUN_RANK.match(raw)
        if r:
            pending = (int(r.group(1)), number)
            continue
        e = _TORCHRUN_EXIT.match(raw)
        if e and pending is not None:
            code = int(e.group(1))
            if code < 0:
                code = 128 - code
            if code not in (0, EXIT_REQUEUE):
                out.append(RankDeath(node, pending[0], code, pending[1]))
                if in_root and root is None:
                    root = out[-1]
            pending = None
    if root is not None:
        out.remove(root)
        out.insert(0, root)
    return out


def _root_death(attempt_path: Path, consequence_ranks: set[int]) -> RankDeath | None:
    """The rank death that caused the others: one by a signal other than the SIGTERM a launcher
    sends to the peers of a failed rank, else one whose log holds no consequence of another's
    failure; on ties the lowest node."""
    deaths: list[RankDeath] = []
    for node, path in node_logs(attempt_path):
        lines = read_tail(path)
        found = rank_deaths(lines, node)
        # A node the job itself stopped (another node failed first; our own SIGKILL after the grace)
        # holds consequences only, whichever signal its ranks died of and whenever it was seen.
        # Every death the launcher reported, not only the one it saw first: under load torchrun's
        # "first observed failure" can be the peer that died of the cause (issue 47).
        if found and not any(_STOPPED_BY_THE_JOB.search(line) for line in lines):
            deaths.extend(found)
    if not deaths:
        return None

    def order(d: RankDeath) -> tuple[int, int, int]:
        # A signal the job did not send, then an exit, then our own SIGTERM (a stop's consequence).
        kind = 1 if d.signal is None else 2 if d.signal == _SIGTERM else 0
        return (kind, 1 if d.rank in consequence_ranks else 0, d.node)

    return min(deaths, key=order)


def _candidates(
    attempt_path: Path, procs_per_node: int, codes: dict[int, int]
) -> list[tuple[int, int, int | None, _RankErrors, Path]]:
    """``(priority, node, rank, errors, path)``; lower priority is more likely the cause."""
    out: list[tuple[int, int, int | None, _RankErrors, Path]] = []
    for node, path in node_logs(attempt_path):
        for local, errors in scan_errors(read_tail(path)).items():
            rank = None if local is None else node * procs_per_node + local
            failed_node = codes.get(node, 1) not in (0, EXIT_REQUEUE)
            priority = (0 if not errors.consequence_only else 2) + (0 if failed_node else 1)
            if local is None:
                priority += 1  # a rank's own error says more than its launcher's summary
            out.append((priority, node, rank, errors, path))
    out.sort(key=lambda c: (c[0], c[3].first_line, c[1]))
    return out


def _death_explanation(
    job_id: str,
    death: RankDeath,
    candidates: list[tuple[int, int, int | None, _RankErrors, Path]],
    attempt_path: Path,
    codes: dict[int, int],
) -> Explanation:
    own = [c for c in candidates if c[2] == death.rank]
    lines = (death.describe(), *(own[0][3].lines if own else []))
    path = next((str(p) for n, p in node_logs(attempt_path) if n == death.node), "")
    return Explanation(job_id, death.node, death.rank, tuple(lines[:MAX_QUOTED]), path, codes)


def explain_failure(
    run_dir: Path | str,
    job_id: str,
    *,
    procs_per_node: int = 1,
    scheduler_logs: Sequence[Path] = (),
) -> Explanation | None:
    """The root failure of the newest attempt of ``run_dir``; None when there is nothing to say.

    A full disk is the cause whenever any log of that attempt says so (:func:`disk_full`), whatever
    the failing rank raised."""
    run_dir = Path(run_dir)
    hung = _hang(run_dir, job_id)
    if hung is not None:
        return hung
    why = _explain(run_dir, job_id, procs_per_node, scheduler_logs)
    disk = disk_full(run_dir, scheduler_logs)
    if disk is None:
        return why
    if why is None:
        return Explanation(job_id, None, None, (), str(run_dir), {}, disk)
    return replace(why, disk=disk)


def _hang(run_dir: Path, job_id: str) -> Explanation | None:
    """The hang watchdog's reason when it ended the newest attempt: its ranks then die of the
    watchdog's SIGKILL, no error of theirs (``wait`` said "rank 0 died of SIGKILL ... killed from
    outside the job" where ``status`` and the notification said hang)."""
    attempts = attempt_dirs(run_dir)
    if not attempts:
        return None
    path = hang_dir(run_dir, attempts[-1][0]) / HANG_REPORT_FILE
    reason = (read_json(path) or {}).get("reason")
    if not isinstance(reason, str) or not reason:
        return None
    return Explanation(job_id, None, None, (reason,), str(path), hang=True)


def _explain(
    run_dir: Path, job_id: str, procs_per_node: int, scheduler_logs: Sequence[Path]
) -> Explanation | None:
    attempts = attempt_dirs(run_dir)
    codes: dict[int, int] = {}
    if attempts:
        attempt_path = attempts[-1][1]
        codes = _exit_codes(attempt_path)
        candidates = _candidates(attempt_path, max(1, procs_per_node), codes)
        # A rank its launcher saw die of a signal (SIGKILL, SIGSEGV, ...) is the cause: its peers'
        # errors ("connection closed", a timeout) are what its death did to them. So is, when no
        # rank wrote an error of its own, the rank that ended first.
        consequence_ranks = {c[2] for c in candidates if c[2] is not None and c[3].consequence_only}
        death = _root_death(attempt_path, consequence_ranks)
        if death is not None and death.signal not in (None, _SIGTERM):
            return _death_explanation(job_id, death, candidates, attempt_path, codes)
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
        if death is not None:
            return _death_explanation(job_id, death, candidates, attempt_path, codes)
    # Errors raised around the launch (set-up, the interpreter, a full disk) reach only the scheduler's files.
    for path in scheduler_logs:
        found = scan_errors(read_tail(path)).get(None)
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


#: What a rank raises when the collective itself failed (not the user's code): a restart can cure it.
_COLLECTIVE_ERROR = re.compile(
    r"NCCL error|ncclInternalError|ncclSystemError|ncclRemoteError|collective operation timeout|"
    r"Watchdog caught collective|ProcessGroupNCCL|ProcessGroupGloo|Gloo connectFullMesh|DistNetworkError|"
    r"DistStoreError",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class RestartVerdict:
    """Whether restarting the training step in the same allocation can cure the newest attempt's
    failure: ``cause`` when it can (a rank killed by a signal, a collective error, a lost task),
    ``refusal`` when it cannot (the user's code raised: running it again raises again)."""

    cause: str | None
    refusal: str | None = None


def restart_verdict(run_dir: Path | str, job_id: str, *, procs_per_node: int = 1) -> RestartVerdict:
    """The newest attempt's failure, sorted into what a restart cures and what it does not.

    Curable: a rank the launcher saw die of a signal other than the launcher's own SIGTERM (SIGKILL,
    the OOM killer, SIGSEGV, SIGABRT...); errors that are only consequences of another rank's death
    ("connection closed by peer", timeouts) with no error of a rank's own; a rank's own error that
    is the collective's (NCCL, gloo, a collective timeout). Not curable: a full disk, and a Python
    exception or a failed self-check raised by a rank (deterministic: FAILED, as without restarts).
    """
    run_dir = Path(run_dir)
    attempts = attempt_dirs(run_dir)
    if not attempts:
        return RestartVerdict(None, "nothing was logged: the failure came before training started")
    if disk_full(run_dir, ()) is not None:
        return RestartVerdict(None, "the disk is full")
    attempt_path = attempts[-1][1]
    codes = _exit_codes(attempt_path)
    candidates = _candidates(attempt_path, max(1, procs_per_node), codes)
    consequence_ranks = {c[2] for c in candidates if c[2] is not None and c[3].consequence_only}
    death = _root_death(attempt_path, consequence_ranks)
    if death is not None and death.signal not in (None, _SIGTERM):
        return RestartVerdict(death.describe())
    own = [c for c in candidates if not c[3].consequence_only]
    if own:
        _, node, rank, errors, _path = own[0]
        where = f"node {node}" + (f" rank {rank}" if rank is not None else "")
        first = errors.lines[0] if errors.lines else "an error"
        if any(_COLLECTIVE_ERROR.search(line) for line in errors.lines):
            return RestartVerdict(f"a collective error on {where}: {first}")
        return RestartVerdict(None, f"{where} raised {first} (the script's own error: not restarted)")
    if death is not None and death.rank not in consequence_ranks:
        # It ended first, by itself, with no sign of another's failure: the script's own exit.
        return RestartVerdict(None, f"{death.describe()}, by itself (the script's own exit: not restarted)")
    if candidates or death is not None or any(c not in (0, EXIT_REQUEUE) for c in codes.values()):
        what = candidates[0][3].lines[0] if candidates and candidates[0][3].lines else "no error of its own"
        return RestartVerdict(f"a rank or node task ended without an error of its own ({what})")
    return RestartVerdict(None, "no failure found in the attempt's logs")
