"""What a scheduler is, on the submitting host and on the node.

On the submitting host (torchx's ``Scheduler``): :meth:`Scheduler.dryrun` turns a plan into a
:class:`Request` whose :meth:`Request.materialize` is the very text :meth:`Scheduler.schedule`
submits, so ``submit --dry-run`` and ``render`` show what runs, byte for byte. ``query`` is batched
(one scheduler call for any number of jobs) and ``cancel`` records the user's intent before it
signals. On the node (submitit's ``JobEnvironment``): one :class:`NodeEnvironment` is the only
reader of the scheduler's environment and owns what happens after training ends there (a Slurm
requeue, a local job's final state).

No code outside :mod:`orchestrator.schedulers` asks which scheduler it runs under: it asks the
scheduler object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from orchestrator.config.scheduler_kinds import SchedulerKind

if TYPE_CHECKING:
    import signal

    from orchestrator.config.plan import LaunchPlan
    from orchestrator.config.profile.load import ClusterProfile
    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import JobRecord, Registry
    from orchestrator.schedulers.query import Allocation, QueryResult


def submission_token(run_dir: Path | str, attempt_base: int) -> str:
    """The token a submission's scheduler job carries (Slurm: ``--comment``), recorded in the
    registry before the scheduler is asked: one per run directory and attempt, so a job whose
    submitting command died can be told apart and adopted. Derived, so :meth:`Scheduler.dryrun`
    stays pure and shows it."""
    import hashlib  # here, not at the top: status never needs it (11M instructions a call)

    digest = hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:16]
    return f"orchestrator-{digest}-a{attempt_base}"


@dataclass(frozen=True)
class Request:
    """One submission, fully decided: what :meth:`Scheduler.schedule` will hand to the scheduler."""

    plan: LaunchPlan
    run_dir: Path
    text: str
    """The submitted text: the batch script (Slurm) or the launch description (local)."""
    file_name: str
    """Where the run directory keeps ``text`` (``sbatch.sh``) and how ``render`` names it."""
    attempt_base: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def materialize(self) -> str:
        return self.text


#: What submitit pickles and calls on each node, named rather than imported (as the batch script
#: names its ``python -m`` modules): the node side sits above the schedulers and imports them.
NODE_ENTRY = "orchestrator.node.entry:NodeTask"


def node_task(run_dir: str, scheduler: str, attempt_base: int = 0, job_key: str = "") -> Any:
    """The picklable per-node callable (:data:`NODE_ENTRY`) for a job in ``run_dir``."""
    import importlib

    module, _, name = NODE_ENTRY.partition(":")
    task_class = getattr(importlib.import_module(module), name)
    return task_class(run_dir=run_dir, scheduler=scheduler, attempt_base=attempt_base, job_key=job_key)


@dataclass(frozen=True)
class Scheduled:
    """What :meth:`Scheduler.schedule` returns: the job's id in the registry and the handle."""

    job_id: str
    scheduler_job_id: str
    handle: Any = None


class Scheduler(ABC):
    """A way to run a plan's nodes; ``orchestrator.schedulers.get_scheduler(name)`` finds one."""

    kind: ClassVar[SchedulerKind]
    """This scheduler's facts (:mod:`orchestrator.config.scheduler_kinds`), declared there once."""
    name: ClassVar[str]
    can_lose_nodes: ClassVar[bool]
    needs_partition: ClassVar[bool]
    writes_batch_script: ClassVar[bool]
    has_arrays: ClassVar[bool] = False
    source_ranks: ClassVar[Mapping[str, int]] = {}
    """This scheduler's own sources of a job's state (what ``SchedulerState.source`` says), ranked:
    lower is more authoritative (:func:`orchestrator.schedulers.query.combine`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is not None:
            cls.name = kind.name
            cls.can_lose_nodes = kind.can_lose_nodes
            cls.needs_partition = kind.needs_partition
            cls.writes_batch_script = kind.writes_batch_script
            cls.has_arrays = kind.has_arrays

    @staticmethod
    def normalize_state(raw: str) -> str:
        """This scheduler's own word for a state, reduced to the spelling of a ``JobState`` value:
        ``status`` shows the word as ``state_detail`` only where it says more than the state. Each
        scheduler answers for its own words (Slurm's ``CANCELLED by 1234``, ``CA``)."""
        return raw.strip().upper()

    # ---------------------------------------------------------------- planning (pure)
    @abstractmethod
    def dryrun(
        self, plan: LaunchPlan, run_dir: Path, attempt_base: int = 0, python: str | None = None
    ) -> Request:
        """The request for ``plan`` in ``run_dir``; no side effect. ``python``: the submitting
        interpreter, the default for the profile's ``python`` key."""

    def main_ip_for_render(self) -> str:
        """The main process address ``render`` shows (marked as a sample where it is one)."""
        return self.kind.render_main_ip

    def rdzv_backend(self, profile: ClusterProfile) -> str:
        """torchrun's rendezvous backend for jobs of this scheduler."""
        return self.kind.rdzv_backend or profile.rdzv_backend

    # ---------------------------------------------------------------- side effects
    @abstractmethod
    def check(self, plan: LaunchPlan) -> None:
        """Refuse (UserError) what the cluster cannot run, before anything is created."""

    def prepare_run_dir(self, registry: Registry | None, run_dir: Path) -> None:  # noqa: B027
        """Before a new job takes over an existing run directory (``resume``)."""

    @abstractmethod
    def schedule(self, request: Request, registry: Registry | None) -> Scheduled:
        """Submit ``request`` exactly as materialized."""

    # ---------------------------------------------------------------- sweeps (job arrays)
    def dryrun_array(
        self, plans: Sequence[LaunchPlan], sweep_dir: Path, max_parallel: int, python: str | None = None
    ) -> Request | None:
        """The one request that runs every plan of a sweep (a job array), or None where the scheduler
        has no arrays (:attr:`has_arrays`). Pure, like :meth:`dryrun`; the plans differ only in their
        script arguments."""
        return None

    def check_array(self, tasks: int) -> None:  # noqa: B027
        """Refuse (UserError) a sweep of ``tasks`` tasks the cluster cannot hold as one array."""

    def schedule_array(
        self, request: Request, task_dirs: Sequence[Path], registry: Registry | None
    ) -> list[Scheduled]:
        """Submit a :meth:`dryrun_array` request exactly as materialized; one Scheduled per task."""
        raise NotImplementedError(f"{self.name} has no job arrays")

    def find_submitted(self, tokens: Sequence[str], since: float) -> dict[str, str] | None:
        """``{token: job id}`` of the scheduler's jobs (submitted since ``since``) that carry one of
        ``tokens``; None when the scheduler did not answer. A scheduler whose submission cannot
        outlive the submitting command knows none."""
        return {}

    def adopt(self, run_dir: Path, job_id: str) -> str:
        """Finish what a killed submission left undone so job ``job_id`` can run; "" when it can,
        else why not (the job is then :meth:`discard`-ed)."""
        return ""

    def discard(self, job_id: str, reason: str) -> None:  # noqa: B027
        """Cancel a job the registry never knew (an orphan that cannot be adopted)."""

    @abstractmethod
    def query(
        self, jobs: Sequence[JobRecord], timeout_s: float, fallback: Mapping[str, JobState]
    ) -> QueryResult:
        """The state of every job in ``jobs``, in one scheduler call."""

    def allocations(self, job_ids: Sequence[str], timeout_s: float) -> dict[str, list[Allocation]] | None:
        """What the scheduler's accounting says each job was allocated (one entry per incarnation, in
        start order): ``orchestrator cost``'s bill. None where the scheduler keeps no accounting or
        did not answer."""
        return None

    def allocations_of(
        self, jobs: Sequence[JobRecord], timeout_s: float
    ) -> dict[str, list[Allocation]] | None:
        """:meth:`allocations` of ``jobs``, for a scheduler that knows its jobs by id (Slurm's
        accounting). A scheduler whose records are the jobs' run directories (local: when each node's
        processes started and ended) reads them here instead."""
        return self.allocations([job.job_id for job in jobs], timeout_s)

    def start_estimate(self, request: Request) -> str | None:
        """When the scheduler would start ``request`` now (its own words, one line), asking it without
        submitting; None where a job starts at once (local) or the scheduler gives no estimate."""
        return None

    @abstractmethod
    def cancel(self, job: JobRecord, sig: signal.Signals | None, user: str) -> str:
        """Cancel (``sig`` None) or signal ``job``; returns the line to print."""

    @abstractmethod
    def log_files(self, run_dir: Path, job_id: str) -> list[Path]:
        """The scheduler's own stdout/stderr files of a job, besides the node logs: where a job that
        failed before any node started (a set-up line, the interpreter) says why."""

    # ---------------------------------------------------------------- a running job's nodes
    def job_nodes(self, job_id: str) -> list[str]:
        """The running job's nodes, expanded; [] when it is not running."""
        return []

    def on_every_node(self, nodes: list[str], job_id: str | None = None) -> list[str] | None:
        """The command prefix that runs a command once on each of ``nodes``, beside the job's running
        step (``job_id``: from outside the allocation); None where the job's nodes are this machine
        (run it here). The hang watchdog, the preflight and ``orchestrator stacks`` reach nodes
        only through this."""
        return None

    def doctor_step(self, profile: ClusterProfile, nodes: int, script: str) -> list[str]:
        """argv of ``orchestrator doctor``'s step: a new allocation of ``nodes`` nodes for the profile,
        one task per node running the shell ``script``, that ends with it. Each line of its output
        (stdout and stderr together) starts with the task's number and ``": "``; each task has
        :data:`~orchestrator.supervise.doctor.NODE_NAME_VAR` set to its node's name. A scheduler
        whose nodes are this machine has none: its nodes share one filesystem, clock and limits, and
        a submit shows their problems at once."""
        from orchestrator.contract.errors import UserError

        raise UserError(
            f"doctor checks a cluster's nodes; a {profile.scheduler} profile's nodes are processes of "
            "this machine (one filesystem, one clock, one set of limits): submit to it directly"
        )

    # ---------------------------------------------------------------- on the node
    @abstractmethod
    def node_environment(self, job_key: str) -> NodeEnvironment:
        """This node's place in the job, read from the scheduler's environment."""


def failed_node(attempt_path: Path, num_nodes: int, me: int) -> tuple[int, int] | None:
    """``(node, exit code)`` of another node whose exit file (``node_<N>.exit``) in this attempt says
    it failed (neither 0 nor a requeue), or None."""
    from orchestrator.contract.run_dir import EXIT_REQUEUE, node_exit_file
    from orchestrator.contract.shared_fs import listed, read_text_listed

    names = listed(attempt_path)  # written on the other nodes' hosts (orchestrator.contract.shared_fs)
    for node in range(num_nodes):
        if node == me:
            continue
        text = read_text_listed(node_exit_file(attempt_path, node), names)
        if text is None:
            continue
        try:
            code = int(text.strip() or 1)
        except ValueError:
            code = 1
        if code not in (0, EXIT_REQUEUE):
            return node, code
    return None


def record_attempt(run_dir: Path, job_id: str, attempt: int, why: str, say: Callable[[str], None]) -> None:
    """An attempt the submitting side never saw (a Slurm requeue of the same id, a restart inside
    the allocation): recorded with the checkpoint it will start from (training picks the newest
    complete one, the same rule). Best effort: the registry must not stop training."""
    if not job_id:
        return
    try:
        from orchestrator.contract.run_dir import last_complete_checkpoint
        from orchestrator.registry.store import Registry

        checkpoint = last_complete_checkpoint(run_dir)
        Registry.open().add_attempt(
            job_id,
            attempt=attempt,
            scheduler_job_id=job_id,
            started_from_checkpoint=str(checkpoint.path) if checkpoint else None,
        )
    except Exception as exc:  # noqa: BLE001
        say(f"attempt {attempt} ({why}) not recorded in the registry: {exc}")


def record_restart(
    run_dir: Path, job_id: str, failed: int, cause: str, in_place: bool, say: Callable[[str], None]
) -> tuple[int, int]:
    """A restart inside the allocation: its line in ``restarts.jsonl`` and the registry's attempt.
    Returns the new attempt's number (the one after every attempt logged) and the step of the
    checkpoint it starts from."""
    import time

    from orchestrator.contract.restarts import append_restart
    from orchestrator.contract.run_dir import last_complete_checkpoint, next_attempt

    attempt = next_attempt(run_dir)
    checkpoint = last_complete_checkpoint(run_dir)
    step = checkpoint.step if checkpoint is not None else 0
    append_restart(
        run_dir,
        {
            "job_id": job_id,
            "failed_attempt": failed,
            "attempt": attempt,
            "cause": cause,
            "step": step,
            "time": time.time(),
            "in_place": in_place,
        },
    )
    record_attempt(run_dir, job_id, attempt, "restarted", say)
    return attempt, step


class NodeEnvironment(ABC):
    """One node's view of its job. The only reader of the scheduler's environment variables."""

    node_rank: int
    num_nodes: int
    hostnames: list[str]
    job_id: str
    restarts: int
    """How many times the scheduler requeued this job (0 on the first run)."""
    shares_host: bool = False
    """Whether the job's nodes share their machine with other jobs' nodes (simulated local nodes):
    its rendezvous port must then be one nobody holds, not one derived from the job id."""
    kill_wait_s: float | None = None
    """Seconds between a SIGTERM and the SIGKILL of whatever training still runs, where the node
    must do it itself (Slurm's KillWait does it on a cluster: None)."""
    shrunk_to: int | None = None
    """Nodes this step runs on when the job shrank after losing a node (fewer than the plan's)."""
    watches_hangs: bool = False
    """Whether node 0 runs the hang watchdog itself (:mod:`orchestrator.node.hang_watch`): where no
    supervisor beside the job does (Slurm's batch step does)."""

    def attempt(self, attempt_base: int) -> int:
        """The attempt this node's task is in: the submission's first plus the scheduler's requeues
        (a scheduler that restarts inside an allocation says its own number)."""
        from orchestrator.contract.run_dir import attempt_number

        return attempt_number(attempt_base, self.restarts)

    @property
    def is_first_node(self) -> bool:
        return self.node_rank == 0

    @property
    def memory_key(self) -> str:
        """Names this node's memory checkpoint folder (``contract.memory_checkpoints``) for as long as
        its memory lives: simulated local nodes share a machine, so their index."""
        return f"node{self.node_rank}"

    def memory_outlives_task(self, plan: LaunchPlan) -> bool:
        """Whether a later task of this allocation on this node may read this task's memory checkpoints
        (a new step after a spare took a lost node's place), so that a task ending badly keeps them."""
        return False

    def stale_memory_keys(self) -> list[str]:
        """Keys of this node's folders of the job's earlier allocations (a task killed with SIGKILL
        could not remove its own): removed at the start."""
        return []

    def ended_jobs_memory(self, user_dir: Path) -> list[Path]:
        """This node's memory checkpoint folders in ``user_dir`` of the user's jobs that have ended
        (tasks killed with SIGKILL could not remove them): removed at the start."""
        return []

    @abstractmethod
    def main_ip(self, plan: LaunchPlan, attempt_path: Path) -> str:
        """The address every node uses to reach node 0."""

    def device_environment(self, plan: LaunchPlan) -> dict[str, str]:
        """Variables that give this node's ranks their GPUs (added to the training environment).
        A real node owns its GPUs; simulated nodes sharing one machine need a share each."""
        return {}

    def failed_peer(self, attempt_path: Path) -> tuple[int, int] | None:
        """``(node, exit code)`` of another node of this job that has failed, or None.

        The node entry point asks this while its training runs and stops its own training when
        one answers: one failed node ends the job within seconds. Slurm needs none of it
        (its step's kill-on-bad-exit ends it), so the default is None."""
        return None

    def keeps_launchers(self, plan: LaunchPlan) -> bool:
        """Whether a node whose ranks failed keeps its launcher and waits for the word to start them
        again in place (:mod:`orchestrator.node.restart_in_place`): only where someone will give it."""
        return False

    def decide_in_place(
        self, plan: LaunchPlan, run_dir: Path, attempt: int, stop_signals: Sequence[int]
    ) -> None:
        """After this node kept its launcher, before it waits for the word: where a node decides
        (node 0 of a local job) it waits for the others, decides and writes the word. Slurm's batch
        step decides: nothing here."""
        return None

    def told_to_stop(self, attempt_path: Path) -> str | None:
        """Why the one who decides asked every node to end its ranks and keep its launcher (Slurm's
        batch step after a hang, the stacks saved), or None. Asked with :meth:`failed_peer`."""
        return None

    def begin(self, run_dir: Path, attempt: int) -> None:
        """Before this node's training starts (a scheduler whose node 0 owns the run's
        notifications starts them here; Slurm's batch step owns them there: nothing)."""
        return None

    def poll_events(self) -> None:
        """While training runs, from the node's wait loop: a scheduler whose node 0 owns the run's
        notifications sends what the run directory says now (a budget 80 % spent); cheap between
        looks. Slurm's batch step polls its own: nothing."""
        return None

    @abstractmethod
    def finish(self, plan: LaunchPlan, run_dir: Path, attempt: int, code: int) -> bool:
        """After this node's training ended with ``code``: record or requeue, as the scheduler needs.
        True when the run went on in a successor job: this job's part ended as it should."""
