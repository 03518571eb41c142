"""CONTRIBUTING.md shows the architecture to the next engineer: its picture names every package of
``orchestrator/`` and every layer ``tests/test_layers.py`` declares, so a new folder cannot land
without a place on the map."""

from __future__ import annotations

from tests.helpers.cli import REPO
from tests.test_layers import LAYERS, MEMBERS


def packages() -> list[str]:
    root = REPO / "orchestrator"
    return sorted(
        p.parent.relative_to(root).as_posix() for p in root.rglob("__init__.py") if p.parent != root
    )


def unnamed(text: str) -> list[str]:
    """Packages whose folder (``name/``, by its last part under its parent's line) and layers whose
    modules the page never names."""
    missing = [
        p for p in packages() if f"{p.rsplit('/', 1)[-1]}/" not in text or f"{p.split('/')[0]}/" not in text
    ]
    for layer in LAYERS:
        if layer in ("", "__main__"):
            continue
        prefixes = MEMBERS.get(layer, (layer,))
        names = [
            f"{prefix.replace('.', '/')}{'.py' if '.' in prefix or prefix == 'version' else '/'}"
            for prefix in prefixes
        ]
        missing += [n for n in names if n not in text]
    return missing


def test_contributing_names_every_package_and_layer() -> None:
    assert packages(), "no packages found"
    assert unnamed((REPO / "CONTRIBUTING.md").read_text()) == []


def test_a_new_package_is_noticed() -> None:
    """The check can fail: a page without ``rundir/`` misses that package and its layer."""
    text = (REPO / "CONTRIBUTING.md").read_text().replace("rundir/", "run dirs")
    assert "rundir" in unnamed(text)
    assert "rundir/" in unnamed(text)
