"""The environment variables the node entry point sets for every rank, each name declared once.

The node side (:mod:`orchestrator.node.entry`) writes them; what runs in a rank (``train/``,
:mod:`orchestrator.rank`, :mod:`orchestrator.hf`, :mod:`orchestrator.loop`, the heartbeat and the
attempt-start record) and the node-side tools that find ranks (stacks) read them.
"""

from __future__ import annotations

#: The run directory (every rank; also how a script knows it runs under orchestrator).
RUN_DIR_ENV = "ORCHESTRATOR_RUN_DIR"
#: The attempt number this launch is (``logs/attempt_<A>/``).
ATTEMPT_ENV = "ORCHESTRATOR_ATTEMPT"
#: This node's rank in the job.
NODE_RANK_ENV = "ORCHESTRATOR_NODE_RANK"
#: The strategy the job asked for (the self-check compares what Accelerate built with it).
STRATEGY_ENV = "ORCHESTRATOR_STRATEGY"
#: The FSDP version of the strategy, when it is an FSDP one.
FSDP_VERSION_ENV = "ORCHESTRATOR_FSDP_VERSION"
#: Processes per node, as planned.
PROCS_PER_NODE_ENV = "ORCHESTRATOR_PROCS_PER_NODE"
#: The world size and node count the self-check expects.
EXPECTED_WORLD_SIZE_ENV = "ORCHESTRATOR_EXPECTED_WORLD_SIZE"
EXPECTED_NUM_NODES_ENV = "ORCHESTRATOR_EXPECTED_NUM_NODES"
#: The job's id (the registry's), for scripts and loggers that name their run after it.
JOB_ID_ENV = "ORCHESTRATOR_JOB_ID"
#: The run's name: its first job's id, the same in every job of the run (a requeue as a new job, an
#: auto-resume, a ``resume``); every command and the API take it for the whole run.
RUN_NAME_ENV = "ORCHESTRATOR_RUN_NAME"
#: "1": the script hooks are installed in the rank (``--no-script-hooks`` sets "0").
SCRIPT_HOOKS_ENV = "ORCHESTRATOR_SCRIPT_HOOKS"
#: The profile's launcher (``direct``: fork the ranks where possible; ``torchrun``).
LAUNCHER_ENV = "ORCHESTRATOR_LAUNCHER"
#: "1" in a rank the direct launcher forked (it leaves by ``os._exit``, never through teardown).
FORKED_RANK_ENV = "ORCHESTRATOR_FORKED_RANK"
#: The world size the run's global batch was chosen for, when the step runs on fewer ranks (a job
#: that shrank after losing a node: ``on_node_loss: shrink``). ``train/`` accumulates gradients
#: over ``this / world size`` times as many micro-batches, so every optimizer step sees as many samples.
BATCH_WORLD_SIZE_ENV = "ORCHESTRATOR_BATCH_WORLD_SIZE"
#: "1": no Accelerate workaround is applied (to measure what they fix).
DISABLE_WORKAROUNDS_ENV = "ORCHESTRATOR_DISABLE_WORKAROUNDS"
#: "1": a Trainer run may train in an output_dir that holds another run's checkpoints (and
#: overwrite them); otherwise it is refused before training (orchestrator.hf).
OVERWRITE_CHECKPOINTS_ENV = "ORCHESTRATOR_OVERWRITE_CHECKPOINTS"
#: The image's Python, torch and accelerate (and warnings), as a containerised node task found them
#: before submitit ran: the node entry writes them into its node log, which ``orchestrator logs`` shows.
CONTAINER_REPORT_ENV = "ORCHESTRATOR_CONTAINER_REPORT"
#: "1" in a Slurm step the batch step may restart in place: a node whose ranks failed keeps its
#: launcher (torch imported, the rendezvous port held) and waits for the batch step's word
#: (``contract.in_place.next_attempt_file``) instead of ending its task. A profile's ``env`` setting
#: it to "0" turns restarts in place off (every restart a new step, as before).
RESTART_IN_PLACE_ENV = "ORCHESTRATOR_RESTART_IN_PLACE"
#: The folder where this node's ranks keep their memory checkpoints (``contract/memory_checkpoints.py``); the
#: node entry sets it for every rank and removes the folder when its task ends.
MEMORY_CKPT_DIR_ENV = "ORCHESTRATOR_MEMORY_CKPT_DIR"
#: Where the node entry makes that folder; a profile's ``env`` may set it (a node whose ``/dev/shm``
#: is small: a local disk). Default ``/dev/shm``, or the temp folder where that is missing.
MEMORY_CKPT_ROOT_ENV = "ORCHESTRATOR_MEMORY_CKPT_ROOT"
