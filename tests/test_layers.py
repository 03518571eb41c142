"""The layers, checked on the import graph (grimp: every import statement, function-level and
``TYPE_CHECKING`` ones included): no cycle, each layer imports only the layers below it, and one
named crossing.

This module is the one place the layers and the crossing are declared; CONTRIBUTING draws them.
"""

from __future__ import annotations

import ast
import graphlib
import re
from collections.abc import Iterable
from pathlib import Path

import grimp
import pytest

from tests.helpers.cli import REPO

PACKAGE = "orchestrator"

#: Each layer and the layers it may import; a module may always import its own layer. A module's
#: layer is the one with the longest matching prefix in :data:`MEMBERS` (a layer's own name otherwise).
LAYERS: dict[str, frozenset[str]] = {
    # this orchestrator's version: a leaf every layer may read
    "version": frozenset(),
    # the run-directory contract, exit codes, node->rank names: data and rules, standard library only
    "contract": frozenset(),
    # what a run is before it runs: strategies, options, profiles, the plan, rendering
    "config": frozenset({"contract"}),
    # SQLite storage only
    "registry": frozenset({"config", "contract"}),
    # a run's events, their once-only claim, and sending them (webhook, command)
    "notify": frozenset({"config", "contract"}),
    # what a scheduler is (the interface, the query records): implementations and callers meet here
    "schedulers.base": frozenset({"registry", "config", "contract"}),
    # what watches a running allocation: reaches the nodes through the interface's methods
    "supervise": frozenset({"schedulers.base", "config", "contract"}),
    # the implementations (Slurm, local) and the factory that loads them by name
    "schedulers": frozenset({"supervise", "schedulers.base", "registry", "notify", "config", "contract"}),
    # inside every rank: never the login side
    "rank": frozenset({"contract", "config.strategies"}),
    # once per node inside the allocation: it starts the ranks, so it may run their code (rank/)
    "node": frozenset({"rank", "schedulers", "schedulers.base", "supervise", "config", "contract"}),
    # what reads a run directory (summaries, series, liveness, logs, plots, export/): no registry
    "rundir": frozenset({"config", "contract"}),
    # the operations that reach the registry and the schedulers: submit, resume, status, cost...
    "runner": frozenset(
        {"rundir", "notify", "schedulers", "schedulers.base", "supervise", "registry", "config", "contract"}
    ),
    # commands carried to a login host over SSH (a profile's login:), the laptop's side
    "remote": frozenset({"runner", "rundir", "registry", "config", "contract", "version"}),
    # the public Python API (typed; no argparse) and its handles (Job, Sweep)
    "api": frozenset({"remote", "runner", "rundir", "registry", "schedulers.base", "config", "contract"}),
    # the web dashboard (``orchestrator ui``): reads through the API only, as ``status`` does
    "ui": frozenset({"api", "contract"}),
    # argparse commands: parse, call the API, print; the login host's agent (``cli/login_agent.py``)
    "cli": frozenset({"api", "ui", "remote", "config", "contract", "version"}),
    # the names users import: ``import orchestrator``, ``orchestrator.hf``, ``orchestrator.loop``
    "": frozenset({"api", "rank", "contract", "version"}),
    "__main__": frozenset({"cli"}),
}

#: The upward edges, each with its reason; nothing else may point up. The first is an import; the
#: others are by-name references (:data:`BY_NAME`): a process started on another host or node.
CROSSINGS: dict[tuple[str, str], str] = {
    ("orchestrator.schedulers.slurm.auto_resume", "orchestrator.runner.submission"): (
        "resubmission from inside an allocation (--auto-resume after a lost node or a hang, "
        "requeue_as: new_job) is a submit, and it goes through the runner's submit"
    ),
    ("orchestrator.schedulers.base", "orchestrator.node.entry"): (
        "the node entry: each node's task (NODE_ENTRY), which a scheduler starts on the node"
    ),
    ("orchestrator.config.render", "orchestrator.schedulers.slurm.batch_step"): (
        "the batch script's last line execs the batch step (job_templates/sbatch.sh.j2)"
    ),
    ("orchestrator.config.container", "orchestrator.schedulers.slurm.container_task"): (
        "a node's task inside a container image starts there (CONTAINER_ENTRY)"
    ),
    ("orchestrator.supervise.preflight", "orchestrator.node.preflight"): (
        "the preflight runs the node's part on every node, through the scheduler"
    ),
    ("orchestrator.supervise.doctor", "orchestrator.node.doctor"): (
        "``orchestrator doctor`` runs the node's part on every node, through the scheduler's step"
    ),
    ("orchestrator.remote.calls", "orchestrator.cli.login_agent"): (
        "the laptop starts the login host's agent over SSH"
    ),
}

#: Every place that loads or starts one of the package's modules by name (a module-name string, a
#: ``-m`` entry, an ``importlib.import_module``/``runpy`` call), with what it may name and why. The
#: test reads the source for them: one not declared here fails, and so does a declaration that no
#: longer matches the source. Their edges join the import graph, so the layer rules apply to them.
BY_NAME: dict[str, tuple[frozenset[str], str]] = {
    "orchestrator.schedulers": (
        frozenset({"orchestrator.schedulers.slurm.scheduler", "orchestrator.schedulers.local.scheduler"}),
        "the scheduler factory: a profile's scheduler, loaded only when asked for (status over local "
        "jobs never imports the Slurm module)",
    ),
    "orchestrator.schedulers.base": (
        frozenset({"orchestrator.node.entry"}),
        "the node entry (NODE_ENTRY), pickled by name into each node's task",
    ),
    "orchestrator.cli.main": (
        frozenset({"orchestrator.cli"}),  # the package: every command module under it
        "each command's module, loaded when that command runs (start-up time)",
    ),
    "orchestrator.config.render": (
        frozenset({"orchestrator.schedulers.slurm.batch_step"}),
        "the batch script it renders execs the batch step",
    ),
    "orchestrator.config.container": (
        frozenset({"orchestrator.schedulers.slurm.container_task"}),
        "the command a container runs on each node",
    ),
    "orchestrator.schedulers.slurm.container_task": (
        frozenset({"orchestrator.schedulers.slurm.container_task"}),
        "its own entry (the docstring), and submitit's node entry run with runpy",
    ),
    "orchestrator.schedulers.slurm.batch_step": (
        frozenset({"orchestrator.schedulers.slurm.batch_step"}),
        "its own entry",
    ),
    "orchestrator.schedulers.slurm.clear_memory": (
        frozenset({"orchestrator.schedulers.slurm.clear_memory"}),
        "its own entry, run on every node by the batch step's end (one srun task per node)",
    ),
    "orchestrator.supervise.preflight": (
        frozenset({"orchestrator.node.preflight"}),
        "the node's part of the preflight, started on every node",
    ),
    "orchestrator.supervise.stacks": (
        frozenset({"orchestrator.supervise.stacks"}),
        "its own entry, on each node",
    ),
    "orchestrator.node.preflight": (frozenset({"orchestrator.node.preflight"}), "its own entry"),
    "orchestrator.supervise.doctor": (
        frozenset({"orchestrator.node.doctor"}),
        "the doctor's part on each node (NODE_MODULE), started by its step",
    ),
    "orchestrator.node.doctor": (frozenset({"orchestrator.node.doctor"}), "its own entry"),
    "orchestrator.node.launcher": (
        frozenset({"orchestrator.node.launcher_shim"}),
        "the prewarmed launcher, started early in its own interpreter",
    ),
    "orchestrator.node.launcher_shim": (frozenset({"orchestrator.node.launcher_shim"}), "its own entry"),
    "orchestrator.cli.login_agent": (frozenset({"orchestrator.cli.login_agent"}), "its own entry"),
    "orchestrator.rank.run_script": (
        frozenset(),
        "runs the user's script with runpy, as ``python script.py`` would (not a module of ours)",
    ),
    "orchestrator.runner.local_sweep": (
        frozenset({"orchestrator.runner.local_sweep"}),
        "a local sweep's detached submitter: itself, in a process of its own",
    ),
    "orchestrator.remote.calls": (
        frozenset({"orchestrator.cli.login_agent"}),
        "the command line the laptop runs on the login host",
    ),
    "orchestrator.config.profile.reference": (
        frozenset({"orchestrator.config.profile.reference"}),
        "its own entry (``--write``)",
    ),
}


#: Layers whose modules do not share one prefix: layer -> its module prefixes.
MEMBERS: dict[str, tuple[str, ...]] = {"schedulers.base": ("schedulers.base", "schedulers.query")}

#: What the contract may not import: it is data and rules, read by ranks and train/ (issue 40).
CONTRACT_FORBIDDEN = frozenset({"subprocess", "socket", "urllib", "http", "threading", "runpy"})


def layer_of(module: str) -> str:
    rel = module[len(PACKAGE) + 1 :] if module != PACKAGE else ""
    if rel == "":
        return ""
    best, best_prefix = "", ""
    for name in LAYERS:
        for prefix in MEMBERS.get(name, (name,)):
            if prefix and (rel == prefix or rel.startswith(prefix + ".")) and len(prefix) > len(best_prefix):
                best, best_prefix = name, prefix
    return best


def imports(graph: grimp.ImportGraph) -> Iterable[tuple[str, str]]:
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            yield importer, imported


def upward_imports(graph: grimp.ImportGraph) -> list[str]:
    found = []
    for importer, imported in imports(graph):
        if (importer, imported) in CROSSINGS:
            continue
        src, dst = layer_of(importer), layer_of(imported)
        allowed = LAYERS[src]
        if src == dst or dst in allowed or imported.removeprefix(PACKAGE + ".") in allowed:
            continue
        if _is_package_init(imported, importer):
            continue
        found.append(f"{importer} ({src or PACKAGE}) -> {imported} ({dst or PACKAGE})")
    return found


def _is_package_init(imported: str, importer: str) -> bool:
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``: those parents are not imports of
    their own (grimp records them only when named). The root package is no such excuse: importing
    ``orchestrator`` from inside it is an import of the API (its ``__getattr__``)."""
    return imported != PACKAGE and importer.startswith(imported + ".")


# ------------------------------------------------------------------ by-name loads and -m entries
#: A module named in a string: ``orchestrator.a.b`` (or ``orchestrator.a.b:Class``).
MODULE_NAME = re.compile(r"orchestrator(?:\.\w+)+")
#: A ``-m`` entry in a command line or a docstring.
ENTRY = re.compile(r"-m\s+[\"']?(orchestrator(?:\.\w+)+)")
#: Calls that load or run a module by name.
DYNAMIC_CALLS = frozenset({"import_module", "__import__", "run_module", "run_path"})
#: Templates render into command lines: their entries are the renderer's references.
TEMPLATE_RENDERER = "orchestrator.config.render"


def module_path(module: str) -> Path:
    base = REPO / Path(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def references_in(source: str, modules: Iterable[str]) -> tuple[set[str], bool]:
    """(the package's modules this source names as strings or ``-m`` entries, whether it calls a
    by-name loader). ``modules`` are the package's modules (a name that is none is not a reference)."""
    known = set(modules)
    found: set[str] = set()
    dynamic = False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(m for m in ENTRY.findall(node.value) if m in known)
            name = node.value.split(":")[0]
            if MODULE_NAME.fullmatch(name) and name in known:
                found.add(name)
        elif isinstance(node, ast.JoinedStr):  # f"orchestrator.cli.{name}"
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and str(first.value).startswith(PACKAGE + "."):
                found.add(str(first.value).rstrip("."))
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            dynamic |= name in DYNAMIC_CALLS
    return found, dynamic


def by_name_references(graph: grimp.ImportGraph) -> tuple[dict[str, set[str]], set[str]]:
    """Every module's by-name references, and the modules that call a by-name loader."""
    refs: dict[str, set[str]] = {}
    loaders: set[str] = set()
    for module in sorted(graph.modules):
        found, dynamic = references_in(module_path(module).read_text(), graph.modules)
        if found:
            refs[module] = found
        if dynamic:
            loaders.add(module)
    for template in sorted((REPO / "job_templates").glob("*.j2")):
        for entry in ENTRY.findall(template.read_text()):
            refs.setdefault(TEMPLATE_RENDERER, set()).add(entry)
    return refs, loaders


def with_by_name_edges(refs: dict[str, set[str]]) -> grimp.ImportGraph:
    """A fresh import graph (grimp's is mutable, the fixture's is shared) with the references added."""
    out = grimp.build_graph(PACKAGE, include_external_packages=False, cache_dir=None)
    for importer, targets in refs.items():
        for imported in targets:
            if imported != importer:
                out.add_import(importer=importer, imported=imported)
    return out


def find_cycle(graph: grimp.ImportGraph) -> tuple[str, ...] | None:
    sorter = graphlib.TopologicalSorter(
        {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    )
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        return tuple(exc.args[1])
    return None


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(PACKAGE, include_external_packages=False, cache_dir=None)


def test_every_module_is_in_a_layer(graph: grimp.ImportGraph) -> None:
    unplaced = [m for m in sorted(graph.modules) if m != PACKAGE and layer_of(m) == "" and m.count(".") > 1]
    assert unplaced == []


def test_no_import_cycle(graph: grimp.ImportGraph) -> None:
    assert find_cycle(graph) is None


def test_each_layer_imports_only_layers_below_it(graph: grimp.ImportGraph) -> None:
    assert upward_imports(graph) == []


def test_each_crossing_is_a_real_edge(graph: grimp.ImportGraph) -> None:
    """A crossing that no longer exists is removed from CROSSINGS, not left to excuse a new one."""
    refs, _ = by_name_references(graph)
    for importer, imported in CROSSINGS:
        assert imported in graph.find_modules_directly_imported_by(importer) | refs.get(importer, set())


def test_every_by_name_load_and_entry_is_declared(graph: grimp.ImportGraph) -> None:
    """What the source names by string (``-m`` entries, ``module:Class``, module names) and who calls
    a by-name loader, against :data:`BY_NAME`: nothing undeclared, no stale declaration."""
    refs, loaders = by_name_references(graph)
    assert {m: sorted(t) for m, t in refs.items()} == {m: sorted(t) for m, (t, _) in BY_NAME.items() if t}
    assert loaders <= set(BY_NAME), sorted(loaders - set(BY_NAME))


def test_by_name_edges_follow_the_layers(graph: grimp.ImportGraph) -> None:
    refs, _ = by_name_references(graph)
    full = with_by_name_edges(refs)
    assert upward_imports(full) == []


def test_a_new_by_name_load_is_found(graph: grimp.ImportGraph) -> None:
    """The rule can fail: ``importlib.import_module("orchestrator.api")`` added to ``remote/`` (the
    agent's old way round a cycle) is an undeclared loader, a reference, and an upward edge."""
    source = module_path("orchestrator.remote.routing").read_text()
    source += (
        '\n\ndef _api():\n    import importlib\n\n    return importlib.import_module("orchestrator.api")\n'
    )
    found, dynamic = references_in(source, graph.modules)
    assert dynamic and "orchestrator.remote.routing" not in BY_NAME
    assert found == {"orchestrator.api"}
    full = with_by_name_edges({"orchestrator.remote.routing": found})
    assert upward_imports(full) == ["orchestrator.remote.routing (remote) -> orchestrator.api (api)"]


def test_a_new_entry_is_found(graph: grimp.ImportGraph) -> None:
    """A ``python -m`` entry in a command line is read like an import."""
    found, _ = references_in('CMD = ["python", "-m", "orchestrator.cli.main"]\n', graph.modules)
    assert found == {"orchestrator.cli.main"}


def test_the_contract_is_data_and_rules() -> None:
    """``contract/`` is read by every rank and by train/: it runs no process, opens no socket,
    starts no thread and runs no script (issue 40). Function-level imports count too."""
    found = []
    for path in sorted((REPO / "orchestrator" / "contract").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in CONTRACT_FORBIDDEN]
    assert found == []


def test_the_contract_rule_can_fail() -> None:
    tree = ast.parse("def f():\n    import subprocess\n")
    assert any(isinstance(n, ast.Import) and n.names[0].name == "subprocess" for n in ast.walk(tree))


def test_layers_allow_only_lower_layers() -> None:
    """The allowed-imports table itself has no cycle: it is an order."""
    layers = {k: set(v) for k, v in LAYERS.items() if k != ""}
    order = list(graphlib.TopologicalSorter(layers).static_order())  # graphlib.CycleError on a cycle
    assert set(order) == set(layers).union(*layers.values())


def test_an_added_upward_import_is_found() -> None:
    """The rule can fail: a registry module that imports the CLI is reported."""
    graph = grimp.build_graph(PACKAGE, include_external_packages=False, cache_dir=None)
    graph.add_import(importer="orchestrator.registry.store", imported="orchestrator.cli.main")
    assert upward_imports(graph) == ["orchestrator.registry.store (registry) -> orchestrator.cli.main (cli)"]
    assert find_cycle(graph) is not None


def test_slurm_commands_are_named_only_in_the_slurm_package() -> None:
    """A third scheduler is one new package: no module outside ``schedulers/slurm/`` names Slurm's
    commands (code, docstrings and comments alike: issue 26's grep)."""
    import re

    pattern = re.compile(r"squeue|sacct|scontrol|\bsrun\b")
    package = REPO / "orchestrator"
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted(package.rglob("*.py"))
        if "schedulers/slurm" not in path.relative_to(package).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


#: Module names that appear in more than one package, each with its reason (issue 40: "no module name
#: repeated across layers without a reason"). A new repeat needs a line here or a better name.
REPEATED_NAMES: dict[str, str] = {
    "cancel": "cli/ prints what runner/ does: a command's module in both",
    "cost": "cli/ prints what runner/ does: a command's module in both",
    "export": "cli/ prints what runner/ does: a command's module in both",
    "logs": "cli/ prints what runner/ does: a command's module in both",
    "resume": "cli/ prints what runner/ does: a command's module in both",
    "status": "cli/ prints what runner/ does: a command's module in both",
    "stacks": "cli/ prints what runner/ gathers through supervise/'s collector on the nodes",
    "render": "cli/render prints what config/render renders",
    "strategies": "cli/strategies prints config/strategies' table",
    "handles": "remote/'s RemoteJob and RemoteSweep are the laptop's twins of api/'s Job and Sweep",
    "hf": "orchestrator.hf is the public name of rank/hf",
    "in_place": "contract/in_place names a restart in place's files; schedulers/slurm/in_place is the batch step's side",
    "loop": "orchestrator.loop is the public name of rank/loop",
    "preflight": "supervise/ runs the preflight from the batch step; node/ is each node's part of it",
    "doctor": "cli/ prints what api/ and runner/ run; supervise/ decides, node/ is each node's part",
    "query": "schedulers/query is the interface's records; schedulers/slurm/query Slurm's answers",
    "scheduler": "each scheduler package's implementation of the interface",
    "schema": "config/profile/schema checks profiles; registry/schema is the SQLite schema",
    "memory_checkpoints": "contract/ names a node's folder and files; rank/ writes and reads them",
}


def test_a_module_name_is_repeated_only_for_a_reason() -> None:
    from collections import Counter

    names = Counter(p.stem for p in (REPO / "orchestrator").rglob("*.py") if p.name != "__init__.py")
    assert sorted(n for n, count in names.items() if count > 1) == sorted(REPEATED_NAMES)
