"""docs/profiles.md's profile reference is generated from the one declaration of profile keys
(orchestrator/config/profile/reference.py), and is never stale."""

from __future__ import annotations

from pathlib import Path

from orchestrator.config.options import OPTIONS
from orchestrator.config.profile.records import ClusterProfile
from orchestrator.config.profile.reference import PAGE, page_section, reference_markdown, write_page


def test_the_pages_copy_is_current() -> None:
    current = page_section(PAGE.read_text())
    assert current is not None, "docs/profiles.md lost its profile-reference markers"
    assert current == reference_markdown(), (
        "docs/profiles.md's profile reference is stale: run `python -m orchestrator.config.profile.reference --write`"
    )


def test_every_key_is_listed_with_its_doc() -> None:
    text = reference_markdown()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines()[2:]}
    for key in ClusterProfile.model_fields:
        assert key in rows, key
        assert not rows[key].rstrip().endswith("|  |"), f"{key} has no documentation"
    for option in OPTIONS:
        assert f"defaults.{option.name}" in rows
    assert "nodes.max" in rows and "signal.seconds_before" in rows


def test_a_changed_declaration_makes_the_copy_stale(tmp_path: Path) -> None:
    """The check can fail: a page whose table misses a row is stale, and --write repairs it."""
    fresh = reference_markdown()
    stale_page = tmp_path / "profiles.md"
    start, end = (
        PAGE.read_text().split("<!-- profile-reference:start", 1)[0],
        "<!-- profile-reference:end -->",
    )
    from orchestrator.config.profile.reference import END, START

    body = "\n".join(line for line in fresh.splitlines() if "`max_requeues`" not in line) + "\n"
    stale_page.write_text(f"{start}{START}\n{body}{end}\n")
    assert end == END
    assert page_section(stale_page.read_text()) != fresh
    assert write_page(stale_page) is True
    assert page_section(stale_page.read_text()) == fresh
    assert write_page(stale_page) is False
