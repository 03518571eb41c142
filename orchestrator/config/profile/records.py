"""Cluster profile records: the typed keys of a profile, each documented where it is declared.

The records are plain immutable values with the bit of pydantic's API the code uses
(attribute access, ==, repr, ``model_dump``, ``model_validate``, ``model_fields``): importing
pydantic and building models costs more than the rest of ``orchestrator render`` together, so
it is left to :mod:`orchestrator.config.profile.schema`, which checks plainly valid values without it
and hands anything doubtful to the pydantic schema that words the errors.

The ``defaults:`` record is not declared here: it is :class:`orchestrator.config.options.TrainingOptions`,
whose fields every other place that knows a training option derives from as well.

The ``_check_*`` functions are the one rule for each cross-value constraint: the fast path and
the pydantic validators both call them, so the two cannot disagree on what is valid.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, ClassVar, Literal, TypeVar

from orchestrator.config.options import TrainingOptions
from orchestrator.config.scheduler_kinds import SchedulerName

#: Slurm accepts these time formats for --time; we accept the same, minus the
#: rarely used "minutes:seconds" (ambiguous with hours:minutes to a human).
#: ``\Z``, not ``$``: ``$`` also matches before a trailing newline, which would let
#: "480G\n" through onto an #SBATCH line and end the #SBATCH block there.
TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+):(\d{2}):(\d{2})\Z|^(?:(\d+)-)(\d+)(?::(\d{2}))?\Z|^(\d+)\Z")
_MEM_RE = re.compile(r"^\d+[KMGT]?\Z")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_SBATCH_KEY_RE = re.compile(r"^[a-z][a-z0-9-]*\Z")
_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP")
#: GPU families without bf16 tensor cores (pre-Ampere); bf16 is refused there.
GPUS_WITHOUT_BF16 = frozenset({"v100", "p100", "t4", "k80", "p40", "p4"})

#: sbatch options the orchestrator owns; extra_sbatch may not override them.
_MANAGED_SBATCH_KEYS = frozenset(
    {
        "nodes", "ntasks-per-node", "partition", "account", "qos", "time", "gpus-per-node", "gres",
        "cpus-per-task", "mem", "constraint", "exclusive", "signal", "output", "error", "job-name",
        "open-mode", "requeue",
    }
)  # fmt: skip


# ---------------------------------------------------------------------------
# Checks shared by the fast path and the pydantic schema (one wording, one rule).
# Each raises ValueError with what was expected; pydantic turns that into a
# ``value_error`` whose message ``_expected`` shows as it is.


def _check_slurm_time(value: str) -> str:
    from orchestrator.config.inputs import slurm_time_minutes

    slurm_time_minutes(value)  # the format, and fields in range: 99:99:99 is no time
    return value


def _check_single_line(value: str | None) -> str | None:
    # These end up on "#SBATCH --key=value" lines, where quoting cannot carry a newline.
    if value is not None and (not value or any(ch in value for ch in "\n\r\0")):
        raise ValueError("a non-empty single-line string (it becomes an #SBATCH option)")
    return value


def _check_interpreter(value: str | None) -> str | None:
    # A path or a command name, on a line of the batch script: a newline would end the command there.
    if value is not None and (not value or any(ch in value for ch in "\n\r\0")):
        raise ValueError("a non-empty single-line path or command name (it runs orchestrator on the nodes)")
    return value


def _check_login_host(value: str | None) -> str | None:
    # One word ssh reads as a destination: a leading dash would be read as an option of ssh.
    if value is not None and (not value or value[0] == "-" or any(c.isspace() or c == "\0" for c in value)):
        raise ValueError("a host as written in ~/.ssh/config: one word, not starting with '-'")
    return value


def _check_slurm_mem(value: str | None) -> str | None:
    if value is not None and not _MEM_RE.match(value):
        raise ValueError("a Slurm memory size such as '480G', '64000M' or '0'")
    return value


def _check_env_names(value: dict[str, Any]) -> dict[str, Any]:
    for name in value:
        if not _ENV_NAME_RE.match(name):
            raise ValueError(f"environment variable names like NCCL_IB_HCA, got {name!r}")
    return value


def _check_sbatch_keys(value: dict[str, Any]) -> dict[str, Any]:
    for key in value:
        if not _SBATCH_KEY_RE.match(key):
            raise ValueError(f"sbatch option names like 'reservation' or 'mail-type', got {key!r}")
        if isinstance(value[key], str) and any(ch in value[key] for ch in "\n\r\0"):
            raise ValueError(f"a single-line value for {key!r} (it becomes an #SBATCH option)")
        if key in _MANAGED_SBATCH_KEYS:
            raise ValueError(f"no {key!r}: it is set from the profile's own key or by the orchestrator")
    return value


def _check_node_limits(default: int, max_: int) -> None:
    if default > max_:
        raise ValueError(f"default ({default}) must be <= max ({max_})")


def _check_port_range(start: int, end: int) -> None:
    if end < start:
        raise ValueError(f"end ({end}) must be >= start ({start})")


def _check_profile(
    scheduler: str, partition: str | None, procs_per_node: int | None, gpus_per_node: int
) -> None:
    from orchestrator.config.scheduler_kinds import scheduler_kind

    if scheduler_kind(scheduler).needs_partition and not partition:
        raise ValueError(f"partition: required when scheduler is '{scheduler}'")
    if procs_per_node and gpus_per_node and procs_per_node > gpus_per_node:
        raise ValueError(f"procs_per_node: {procs_per_node} is more than gpus_per_node ({gpus_per_node})")


# ---------------------------------------------------------------------------
# The profile classes: immutable records (attribute access, ==, repr, model_dump,
# model_validate, model_fields), the documentation of every key.

_REQUIRED: Any = object()  # marks a key without default in ``model_fields``
#: The schema's ``validate`` (:mod:`orchestrator.config.profile.schema`, which imports these records),
#: registered by the schema when it is imported. The package's ``__init__`` imports the schema, so it
#: is set before any record can be built; the records import neither it nor pydantic.
VALIDATORS: list[Callable[..., Any]] = []


def _validator() -> Callable[..., Any]:
    return VALIDATORS[0]


_R = TypeVar("_R", bound="_Record")


class _Record:
    """Base of the profile classes: frozen values with the bit of pydantic's API the code uses.

    ``model_fields`` maps each key, in order, to its default (``_REQUIRED`` when there is none).
    Constructing one validates (like the pydantic models these replaced); the loaders build them
    through ``profile_schema.validate``, which only falls back to pydantic when a value is doubtful.
    A record may also take its keys from a dataclass base (``TrainingDefaults``): then the
    dataclass's fields are the keys, and instances are instances of that dataclass too.
    """

    model_fields: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        if dataclasses.is_dataclass(cls):
            cls.model_fields = {
                f.name: _REQUIRED if f.default is dataclasses.MISSING else f.default
                for f in dataclasses.fields(cls)
            }
            return
        names = [n for n in cls.__dict__.get("__annotations__", {}) if not n.startswith("_")]
        cls.model_fields = {n: cls.__dict__.get(n, _REQUIRED) for n in names}

    def __init__(self, **data: Any) -> None:
        cls = type(self)
        if not data and _REQUIRED not in cls.model_fields.values():
            # All defaults (also how the class bodies below get theirs): valid by definition.
            values = {k: v.copy() if isinstance(v, (dict, list)) else v for k, v in cls.model_fields.items()}
        else:
            values = _validator()(cls, data).__dict__
        self.__dict__.update(values)

    @classmethod
    def _make(cls: type[_R], values: dict[str, Any]) -> _R:
        """An instance from values already checked (no validation)."""
        obj = object.__new__(cls)
        obj.__dict__.update(values)
        return obj

    @classmethod
    def model_validate(cls: type[_R], obj: Any, *, strict: bool | None = None) -> _R:
        """Validate a mapping (pydantic's semantics; raises ``pydantic.ValidationError``)."""
        return _validator()(cls, obj, strict)

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        """Plain dicts/lists/scalars, every key in order (all values are JSON types already)."""
        out: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            if isinstance(value, _Record):
                value = value.model_dump(mode)
            elif isinstance(value, (dict, list)):
                value = value.copy()
            out[name] = value
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash((type(self), *self.__dict__.values()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


class NodeLimits(_Record):
    default: int = 1
    """Nodes a job gets when ``--nodes`` is not given (>= 1)."""
    max: int = 1
    """Most nodes one job may ask for (the partition's or the QoS's limit; >= 1, >= default)."""


class PortRange(_Record):
    start: int = 29500
    """First port for the rendezvous (1024..65535); the job id picks one inside the range so two
    jobs sharing a node never collide."""
    end: int = 29999
    """Last port of the range (inclusive; 1024..65535, >= start)."""


class PreTimeoutSignal(_Record):
    name: Literal["USR1", "USR2", "TERM", "INT", "HUP"] = "USR2"
    """Signal Slurm sends before the time limit (``--signal=<name>@<seconds>``).
    USR2 by default: NCCL claims USR1, and TERM is what preemption sends."""
    seconds_before: int = 120
    """How long before the time limit it arrives (10..3600): enough for one step plus a checkpoint."""


class Preflight(_Record):
    """Checks run inside the allocation before training: a bad node ends the job within seconds,
    named, instead of after the first collective times out (gloo 30 min, NCCL 10 min)."""

    enabled: bool = True
    """Run the preflight before every attempt. Off: training starts at once (the test cluster's
    profile turns it off to keep the suite fast)."""
    timeout_s: int = 60
    """Bound on the whole preflight step (5..3600 s); a node whose check has not finished by then is
    named. Covers start-up (torch's import) and the rendezvous too."""
    max_latency_ms: float = 20.0
    """Most round-trip time of a tiny message between node 0 and another node (milliseconds, best
    of a few tries: a busy host's noise never fails a good link)."""
    min_bandwidth_mbps: float = 1000.0
    """Least bandwidth of a 1 MiB transfer between node 0 and another node, in each direction
    (megabits per second, best of 3). 1000: any training interconnect is far above it."""
    min_free_mb: int = 1024
    """Free space the run directory must have on every node beyond the newest complete checkpoint's
    size (MiB), so the next checkpoint fits."""


class Login(_Record):
    """The cluster's login host, reached over SSH from a laptop: with ``host`` set, every command run
    with this profile runs on the login host's orchestrator (``orchestrator.remote``)."""

    host: str | None = None
    """Host as written in ``~/.ssh/config`` (so ProxyJump, User, IdentityFile and agents apply).
    None: this machine is the login host."""
    user: str | None = None
    """User name there (``ssh -l``); None: ssh's own choice (``User`` in ssh_config)."""
    port: int | None = None
    """SSH port (1..65535); None: ssh's own choice."""
    ssh_config: str | None = None
    """An ssh_config file to read instead of ``~/.ssh/config`` (``ssh -F``)."""
    connect_timeout: int = 10
    """Seconds to reach the host (1..300): an unreachable host is named within it."""
    python: str = "~/.orchestrator/venv/bin/python"
    """The interpreter that runs orchestrator on the login host (``orchestrator remote install``
    puts one there); ``~/`` is that host's home."""
    profile: str | None = None
    """The profile's name on the login host; None: the same name as here."""
    home: str | None = None
    """``ORCHESTRATOR_HOME`` on the login host (its registry); None: its default."""
    runs: str | None = None
    """``ORCHESTRATOR_RUNS`` on the login host (the runs root); None: its default."""


class Container(_Record):
    """The image every node's task runs in (``orchestrator.config.container`` renders it). The run
    directory (with its code snapshot), the script's folder and orchestrator's own node-side code are
    mounted without being asked; the image needs Python, torch and accelerate, not orchestrator."""

    runtime: str = "none"
    """``pyxis`` (enroot: ``--container-image`` on the step), ``oci`` (Slurm's own ``--container`` with
    the runtime of ``oci.conf``), ``apptainer`` or ``podman`` (wrap the node command), ``none``."""
    image: str | None = None
    """pyxis: an enroot image (``nvcr.io#nvidia/pytorch:25.01-py3``, a ``.sqsh``); apptainer: a
    ``.sif`` or ``docker://...``; podman: an image name, or a root filesystem folder (absolute path);
    oci: a root filesystem folder or an OCI bundle (a folder with ``rootfs/`` and ``config.json``)."""
    mounts: list[str] = []
    """More folders to mount: ``SRC``, ``SRC:DST`` or ``SRC:DST:ro`` (absolute paths; SRC must exist
    on the submitting host, which shares its filesystem with the nodes)."""
    workdir: str | None = None
    """Working folder inside the container; None: the run directory."""
    env: dict[str, str | int | bool] = {}
    """Variables set inside the container (over the image's own); the profile's ``env:`` and the
    scheduler's variables of the task cross in as well."""
    python: str = "python3"
    """The image's interpreter (a path or a name on the image's PATH)."""


class Notify(_Record):
    """Where a run's events are sent, each once, in order (``orchestrator.notify.outbox``). The webhook URL
    is a secret: name where the node and the login host read it, never the URL itself."""

    webhook_env: str | None = None
    """An environment variable holding a webhook URL (Slack-compatible: ``{"text": ...}`` is POSTed)."""
    webhook_file: str | None = None
    """A file holding the webhook URL, from ``/`` or ``~/`` (the sender's home), read when an event is sent."""
    command: str | None = None
    """A shell command run per event: the event as JSON on stdin, ``ORCHESTRATOR_EVENT``(``_TEXT``)."""
    timeout_s: int = 60
    """How long the job's owner stays at its end for events not yet sent (1..600 s); the next owner of
    the run (the next attempt, a resumed job) sends what is left."""


class TrainingDefaults(_Record, TrainingOptions):
    """A profile's ``defaults:``: the strategy options used unless the command line says otherwise.

    Keys, types, defaults and documentation are :class:`~orchestrator.config.options.TrainingOptions`'s
    (an instance is one); this class only adds the record behaviour every profile key has.
    """


class ClusterProfile(_Record):
    """One cluster, as a job on it needs to know it."""

    description: str = ""
    """One line shown by ``orchestrator profiles list``."""
    scheduler: SchedulerName
    """``slurm`` submits through sbatch; ``local`` runs simulated nodes on this machine."""
    partition: str | None = None
    """Slurm partition (``--partition``); required for slurm profiles."""
    account: str | None = None
    """Slurm account to charge (``--account``)."""
    qos: str | None = None
    """Quality of service (``--qos``)."""
    time_limit: str = "01:00:00"
    """Default wall-clock limit, in Slurm's format: ``HH:MM:SS``, ``D-HH:MM:SS`` or minutes."""
    nodes: NodeLimits = NodeLimits()
    """Default and maximum node count of one job."""
    gpus_per_node: int = 0
    """GPUs on one node (0..64); 0 means a CPU cluster (gloo backend, one process per ``procs_per_node``)."""
    gpu_type: str | None = None
    """GPU model (``a100``, ``h100``, ...): used in ``--gres`` and to refuse bf16 on pre-Ampere GPUs."""
    procs_per_node: int | None = None
    """Training processes per node (1..256); defaults to ``gpus_per_node`` (or 1 on CPU)."""
    cpus_per_task: int = 1
    """CPUs for the one Slurm task per node (1..1024; it hosts every training process of the node)."""
    max_procs_per_node: int | None = None
    """Most training processes one node may run (1..1024). None: the GPUs per node on GPU profiles;
    on CPU profiles the partition's CPUs per node (Slurm), or 256."""
    share_with_group: bool = False
    """Run directories readable by the owner's group (0750 / 0640) instead of owner-only (0700 /
    0600): for team clusters. Logs, ``sbatch.sh`` (with the ``env:`` values) and checkpoints follow."""
    mem: str | None = None
    """Memory per node in Slurm's format (``480G``); None leaves Slurm's default; ``0`` means all of it."""
    constraint: str | None = None
    """Node features (``--constraint``)."""
    exclusive: bool = False
    """Ask for whole nodes (``--exclusive``): expected for multi-GPU training."""
    extra_sbatch: dict[str, str | int | bool] = {}
    """Further ``#SBATCH --key=value`` lines (keys without dashes, e.g. ``reservation``)."""
    setup: list[str] = []
    """Shell lines run on every node before training (``module load``, ``source venv/bin/activate``).
    They are the profile author's own shell code and run as written."""
    python: str | None = None
    """The interpreter that runs orchestrator on the nodes. A path, or a command name looked up on
    PATH after the ``setup`` lines ran (e.g. ``python3`` from a venv that setup activates), so nodes
    with their own venv or another CPU architecture work. None: the submitting interpreter
    (``sys.executable``), as submitit does."""
    env: dict[str, str | int | bool] = {}
    """Environment variables for training (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...); values are quoted."""
    network_interface: str | None = None
    """Interface whose address the first node advertises as the main process IP
    (e.g. ``ib0``); None uses the address its hostname resolves to."""
    rdzv_backend: Literal["c10d", "static"] = "c10d"
    """torchrun rendezvous: c10d (elastic, default) or static (torchrun launches only: see ``launcher``)."""
    launcher: Literal["direct", "torchrun"] = "direct"
    """How a node starts its DDP, FSDP and DeepSpeed ranks: ``direct`` forks them from the launcher,
    which has imported torch once for all of them (no second import per rank, no torchrun agent);
    ``torchrun`` is ``accelerate launch``'s own way (DeepSpeed's always, before 2026-11-29)."""
    port_range: PortRange = PortRange()
    """Ports the rendezvous may use."""
    signal: PreTimeoutSignal = PreTimeoutSignal()
    """Pre-timeout signal: the job checkpoints and requeues itself when it arrives."""
    max_requeues: int = 3
    """How many times a job may requeue itself after preemption or time-out (0..100)."""
    requeue_as: Literal["auto", "same_job", "new_job"] = "auto"
    """How a stopped job comes back: ``same_job`` (the scheduler's own requeue: same job id and queue
    priority, but Slurm holds it for ``cred_expire`` + 1 s, 121 s by default) or ``new_job`` (a
    successor job submitted when the stop signal arrives, starting as soon as this one ends: a new
    job id and a fresh place in the queue; ``status`` follows the run); ``auto``: ``new_job`` where
    the cluster's ``cred_expire`` would hold a requeue 30 s or more (Slurm's default), else
    ``same_job``, decided by node 0 when the stop comes. All count to max_requeues."""
    max_restarts: int = 3
    """How many times the job's own supervisor restarts the training step inside its allocation (same
    job id, no trip through the queue) after a fault a restart cures: a rank or node task killed by a
    signal (the OOM killer, SIGSEGV, SIGABRT), a collective error or timeout, a hang (0..100; 0: every
    such fault ends the job, as before). A Python exception the script raised is never restarted.
    Counted per allocation (Slurm); ``--max-restarts`` overrides it."""
    spare_nodes: int = 0
    """Nodes allocated beyond ``nodes`` that wait idle, preflighted with the others (0..64; Slurm). A
    training node lost (dead, or named by the preflight or the hang watchdog) is left out and a spare
    takes its place: the step restarts in the same allocation, from the newest complete checkpoint,
    counted by ``max_restarts``. The job is submitted with Slurm's no-kill option, so that the allocation
    outlives a node's failure; the batch host's death is still a requeue."""
    on_node_loss: Literal["end", "shrink"] = "end"
    """What a lost node does when no spare is left (Slurm): ``end`` the step (``--auto-resume``
    submits a new job without the node) or ``shrink``: restart inside the allocation on the nodes
    left, from the newest complete checkpoint (resharded as ``resume --nodes`` does), ``train/``
    keeping the global batch by accumulating gradients; refused, with the reason in the job's log,
    where the strategy cannot reshard (DeepSpeed) or the world size does not divide the old one."""
    hang_timeout: int | None = None
    """Seconds without progress of any rank (heartbeats) before the hang watchdog saves every rank's
    stacks and ends the job (1..86400). Longer during the first step and while checkpointing. None:
    20 median step times, at least 300 s. ``--hang-timeout`` overrides it."""
    price_per_gpu_hour: float | None = None
    """What one GPU-hour costs (any currency, >= 0): ``orchestrator cost`` turns the hours of a run into
    money with it. None: the bill stays in hours."""
    price_per_cpu_hour: float | None = None
    """What one CPU-hour costs, for a cluster without GPUs (``gpus_per_node: 0``): as
    ``price_per_gpu_hour``."""
    budget: str | None = None
    """Every run's spending cap unless ``--budget`` says otherwise: ``200gpu-h``, ``0.5cpu-h``, or money
    at the price above (``500usd``). Counted over all of a run's attempts; the job checkpoints and stops
    (state ``BUDGET``) before the next checkpoint interval would pass it. None: no cap."""
    preflight: Preflight = Preflight()
    """Checks before training (run directory, free space, GPU count, links between nodes)."""
    defaults: TrainingDefaults = TrainingDefaults()
    """Strategy options used unless the command line says otherwise."""
    login: Login = Login()
    """The login host, when commands start on a laptop: see :class:`Login`."""
    container: Container = Container()
    """The container image the nodes' tasks run in: see :class:`Container`."""
    notify: Notify = Notify()
    """Notifications of started, requeued, resumed, hang, failed, completed: see :class:`Notify`."""

    @property
    def default_procs_per_node(self) -> int:
        return self.procs_per_node or self.gpus_per_node or 1

    @property
    def supports_bf16(self) -> bool:
        return self.gpus_per_node == 0 or (self.gpu_type or "").lower() not in GPUS_WITHOUT_BF16

    @property
    def supports_fp16(self) -> bool:
        return self.gpus_per_node > 0


def time_minutes(limit: str) -> int:
    """A time limit (``D-HH:MM:SS``, ``HH:MM:SS``, minutes) in whole minutes, rounded up."""
    days = 0
    if "-" in limit:
        d, limit = limit.split("-", 1)
        days = int(d)
    parts = [int(p) for p in limit.split(":")]
    if len(parts) == 1 and days == 0:
        return parts[0]
    while len(parts) < 3:
        parts.append(0)
    hours, minutes, seconds = parts[:3]
    return days * 1440 + hours * 60 + minutes + (1 if seconds else 0)
