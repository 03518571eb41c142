"""The tests mirror the package, and what they share is defined once (issue 40).

* Every test module lies in ``tests/<package>/`` for a package of ``orchestrator/`` (``tests/train/``
  for ``train/``; ``tests/cluster/`` for what needs the real Slurm cluster), or is one of the
  cross-cutting checks at the top.
* The ``slurm`` mark comes from the folder (``tests/conftest.py``): no test module writes it, each
  test under ``tests/cluster/`` gets it, and one elsewhere that carries it stops the run.
* Helpers live in ``tests/helpers/``: no test module defines a function named like one there, and no
  two modules define the same function (same parameters and body, under any name): import it.
* Every test checks something: an ``assert``, ``pytest.raises``/``fail``/``warns``, a ``raise``, or a
  call of a function of the tests that does.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import CLUSTER_TESTS, mark_cluster_tests
from tests.helpers.cli import REPO

TESTS = REPO / "tests"
HELPERS = TESTS / "helpers"
#: Folders of tests that are not a package of orchestrator/: what they hold instead.
OTHER_FOLDERS = {
    "cluster": "tests on the real Slurm test cluster (marked slurm by folder)",
    "train": "train/, the reference training program",
    "helpers": "what the tests share",
    "scripts": "scripts the tests run as users' scripts",
    "golden": "golden files",
}
#: Test modules at the top of tests/: checks across the whole project, not of one package.
TOP_LEVEL = {
    "test_architecture.py",
    "test_contributing.py",
    "test_docs.py",
    "test_golden.py",
    "test_layers.py",
    "test_packaging.py",
    "test_readme_quickstart.py",
    "test_static_checks.py",
    "test_tests_layout.py",
}


def python_files(under: Path = TESTS) -> list[Path]:
    """The tests' Python modules (test modules, conftests, helpers), without tests/scripts/ (users'
    scripts, run as subprocesses)."""
    return sorted(
        p for p in under.rglob("*.py") if "__pycache__" not in p.parts and TESTS / "scripts" not in p.parents
    )


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """A module's top-level functions that are neither tests, fixtures nor pytest hooks."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = " ".join(ast.unparse(d) for d in node.decorator_list)
        if node.name.startswith(("test_", "pytest_")) or "fixture" in decorators or "hookimpl" in decorators:
            continue
        found.append(node)
    return found


def shape(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """Parameters and body, without the name and the docstring: equal for a copy under another name."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(node.args) + ast.dump(ast.Module(body=body, type_ignores=[]))


def test_test_folders_mirror_the_package() -> None:
    strays = []
    for folder in sorted(p for p in TESTS.rglob("*") if p.is_dir() and "__pycache__" not in p.parts):
        rel = folder.relative_to(TESTS)
        if rel.parts[0] in OTHER_FOLDERS:
            continue
        if not (REPO / "orchestrator" / rel / "__init__.py").is_file():
            strays.append(f"tests/{rel}/ (no package orchestrator/{rel})")
    top = {p.name for p in TESTS.glob("test_*.py")}
    strays += [f"tests/{name} (put it under tests/<package>/)" for name in sorted(top - TOP_LEVEL)]
    assert strays == []


def test_no_test_module_writes_the_slurm_mark() -> None:
    marked = []
    for path in python_files():
        if not path.name.startswith("test_") or path == Path(__file__).resolve():
            continue  # the conftest gives the mark; this module makes one to see it refused
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "slurm"
                and ast.unparse(node).endswith("mark.slurm")
            ):
                marked.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert marked == [], "the slurm mark comes from the folder: tests/cluster/ (tests/conftest.py)"


class FakeItem(SimpleNamespace):
    def get_closest_marker(self, name: str) -> object | None:
        return next((m for m in self.own_marks if m.name == name), None)

    def add_marker(self, mark: pytest.MarkDecorator) -> None:
        self.own_marks.append(mark.mark)


def test_the_cluster_folder_marks_its_tests_slurm() -> None:
    inside = FakeItem(path=CLUSTER_TESTS / "test_x.py", nodeid="tests/cluster/test_x.py::t", own_marks=[])
    outside = FakeItem(path=TESTS / "runner" / "test_x.py", nodeid="tests/runner/test_x.py::t", own_marks=[])
    mark_cluster_tests([inside, outside])
    assert inside.get_closest_marker("slurm") is not None
    assert outside.get_closest_marker("slurm") is None


def test_a_slurm_mark_outside_the_cluster_folder_stops_the_run() -> None:
    stray = FakeItem(
        path=TESTS / "runner" / "test_x.py",
        nodeid="tests/runner/test_x.py::t",
        own_marks=[pytest.mark.slurm.mark],
    )
    with pytest.raises(pytest.UsageError, match="tests/runner/test_x.py::t"):
        mark_cluster_tests([stray])


def test_only_the_cluster_folder_can_ask_for_the_cluster() -> None:
    """The ``slurm_cluster`` fixture lives in tests/cluster/conftest.py: elsewhere it does not exist."""
    defined = [
        str(path.relative_to(REPO))
        for path in python_files()
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "slurm_cluster"
    ]
    assert defined == ["tests/cluster/conftest.py"]


def test_no_test_module_defines_a_helper_again() -> None:
    helpers = {
        f.name: path for path in python_files(HELPERS) for f in functions(path) if not f.name.startswith("_")
    }
    again = [
        f"{path.relative_to(REPO)}:{f.lineno} {f.name} (import it from {helpers[f.name].relative_to(REPO)})"
        for path in python_files()
        if HELPERS not in path.parents
        for f in functions(path)
        if f.name in helpers
    ]
    assert again == []


def test_no_function_is_defined_twice() -> None:
    places = collections.defaultdict(list)
    for path in python_files():
        for f in functions(path):
            places[shape(f)].append(f"{path.relative_to(REPO)}:{f.lineno} {f.name}")
    copies = [where for where in places.values() if len(where) > 1]
    assert copies == [], "one copy in tests/helpers/, imported by the others"


def test_the_checks_see_a_copy() -> None:
    """The two checks above find what they look for (a copy made here, in memory)."""
    (original,) = [f for f in functions(HELPERS / "net.py") if f.name == "free_port"]
    copy = ast.parse(ast.unparse(original).replace("def free_port", "def _port")).body[0]
    assert isinstance(copy, ast.FunctionDef) and shape(copy) == shape(original)


def checks(node: ast.AST) -> bool:
    """``node`` asserts, raises, or asks pytest to (``pytest.raises``, ``fail``, ``warns``)."""
    for x in ast.walk(node):
        if isinstance(x, (ast.Assert, ast.Raise)):
            return True
        if (
            isinstance(x, ast.Attribute)
            and x.attr in ("raises", "fail", "warns")
            and ast.unparse(x.value) == "pytest"
        ):
            return True
    return False


def called_names(node: ast.AST) -> set[str]:
    return {
        f.attr if isinstance(f, ast.Attribute) else f.id
        for x in ast.walk(node)
        if isinstance(x, ast.Call) and isinstance(f := x.func, (ast.Attribute, ast.Name))
    }


def assertion_free(modules: list[ast.Module]) -> list[str]:
    """The test functions of ``modules`` that check nothing, by the rule above (the functions of all of
    ``modules`` count as helpers, by name, whatever they call in turn)."""
    defs: dict[str, list[ast.AST]] = collections.defaultdict(list)
    for module in modules:
        for node in ast.walk(module):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs[node.name].append(node)
    checking = {name for name, nodes in defs.items() if any(checks(n) for n in nodes)}
    grew = True
    while grew:
        more = {
            n
            for n, nodes in defs.items()
            if n not in checking and any(called_names(x) & checking for x in nodes)
        }
        checking |= more
        grew = bool(more)
    return [
        node.name
        for module in modules
        for node in ast.walk(module)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("test_")
        and not checks(node)
        and not called_names(node) & checking
    ]


def test_every_test_checks_something() -> None:
    modules = [ast.parse(path.read_text()) for path in python_files()]
    assert assertion_free(modules) == []


def test_an_assertion_free_test_is_found() -> None:
    module = ast.parse(
        "def _fine(x):\n    assert x\n"
        "def test_checks():\n    _fine(1)\n"
        "def test_checks_nothing():\n    with open(__file__):\n        pass\n"
    )
    assert assertion_free([module]) == ["test_checks_nothing"]
