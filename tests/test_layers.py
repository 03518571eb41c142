"""The layers, checked on the import graph (grimp: every import statement, function-level and
``TYPE_CHECKING`` ones included): no cycle, each layer imports only the layers below it, and one
named crossing.

This module is the one place the layers and the crossing are declared; CONTRIBUTING draws them.
"""

from __future__ import annotations

import graphlib
from collections.abc import Iterable

import grimp
import pytest

from tests.helpers.cli import REPO

PACKAGE = "orchestrator"

#: Each layer and the layers it may import; a module may always import its own layer. A module's
#: layer is the one with the longest matching prefix in :data:`MEMBERS` (a layer's own name otherwise).
LAYERS: dict[str, frozenset[str]] = {
    # the run-directory contract, exit codes, node->rank names: standard library only
    "contract": frozenset(),
    # what a run is before it runs: strategies, options, profiles, the plan, rendering
    "config": frozenset({"contract"}),
    # SQLite storage only
    "registry": frozenset({"config", "contract"}),
    # what a scheduler is (the interface, the query records): implementations and callers meet here
    "schedulers.base": frozenset({"registry", "config", "contract"}),
    # what watches a running allocation: reaches the nodes through the interface's methods
    "supervise": frozenset({"schedulers.base", "config", "contract"}),
    # the implementations (Slurm, local) and the factory that loads them by name
    "schedulers": frozenset({"supervise", "schedulers.base", "registry", "config", "contract"}),
    # once per node inside the allocation
    "node": frozenset({"schedulers", "schedulers.base", "supervise", "config", "contract"}),
    # inside every rank: never the login side
    "rank": frozenset({"contract", "config.strategies"}),
    # the engine under the API
    "core": frozenset({"schedulers", "schedulers.base", "supervise", "registry", "config", "contract"}),
    # commands carried to a login host over SSH (a profile's login:), and the agent run there
    "remote": frozenset({"core", "registry", "config", "contract"}),
    # the public Python API (typed; no argparse)
    "api": frozenset({"remote", "core", "registry", "schedulers.base", "config", "contract"}),
    # the web dashboard (``orchestrator ui``): reads through the API only, as ``status`` does
    "ui": frozenset({"api", "contract"}),
    # argparse commands: parse, call the API, print (``cli/ui.py`` starts the dashboard)
    "cli": frozenset({"api", "ui", "remote", "config", "contract"}),
    # the names users import: ``import orchestrator``, ``orchestrator.hf``, ``orchestrator.loop``
    "": frozenset({"api", "rank", "contract"}),
    "__main__": frozenset({"cli"}),
}

#: The one upward import: resubmission from inside an allocation (``--auto-resume`` after a lost
#: node or a hang, ``requeue_as: new_job``) is a submit, and it goes through core's submit.
CROSSINGS: frozenset[tuple[str, str]] = frozenset(
    {("orchestrator.schedulers.slurm.auto_resume", "orchestrator.core.submission")}
)


#: Layers whose modules do not share one prefix: layer -> its module prefixes.
MEMBERS: dict[str, tuple[str, ...]] = {"schedulers.base": ("schedulers.base", "schedulers.query")}


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
    their own (grimp records them only when named)."""
    return importer.startswith(imported + ".")


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


def test_the_crossing_is_a_real_import(graph: grimp.ImportGraph) -> None:
    """A crossing that no longer exists is removed from CROSSINGS, not left to excuse a new one."""
    for importer, imported in CROSSINGS:
        assert imported in graph.find_modules_directly_imported_by(importer)


def test_layers_allow_only_lower_layers() -> None:
    """The allowed-imports table itself has no cycle: it is an order."""
    order = graphlib.TopologicalSorter({k: set(v) for k, v in LAYERS.items() if k != ""})
    order.prepare()


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
