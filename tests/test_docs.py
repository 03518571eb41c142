"""The README and the reference pages under docs/: the README stays a short start (<= 250 lines) that
links every page; every relative link, image and anchor resolves; every repository path and
``orchestrator.`` name the text shows in backticks exists; and every ``orchestrator ...`` command line
shown in a code block parses with the real CLI parser (the one ``orchestrator/cli/main.py`` builds,
each subcommand's own ``add_arguments``, abbreviations refused), so a renamed or removed flag fails
here. Flags named in inline synopses (``orchestrator logs JOB [-f] [--node N]``) and in the prose
(``--hang-timeout S``) must be some command's too.

What the quick start's commands do when run is ``tests/test_readme_quickstart.py``'s to prove.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cli.main import COMMANDS, build_parser
from tests.helpers.cli import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 250

#: Paths the text shows that are the user's own, not the repository's.
USER_PATHS = {"cluster_profiles/mycluster.yaml"}
#: Top-level folders whose paths in backticks must exist (run-directory paths such as
#: ``logs/attempt_N/`` are not the repository's).
REPO_TOPS = (
    "orchestrator/",
    "tests/",
    "bench/",
    "train/",
    "examples/",
    "job_templates/",
    "cluster_profiles/",
    ".ci/",
)

#: Other tools' flags the text quotes (sbatch, srun, pyxis, podman, apptainer): not orchestrator's.
FOREIGN_FLAGS = {
    *("--array", "--kill-on-invalid-dep", "--dependency", "--requeue", "--comment", "--partition"),
    *("--account", "--qos", "--gres", "--constraint", "--exclusive", "--container", "--container-mounts"),
    *("--container-workdir", "--no-container-mount-home", "--container-env", "--nv", "--rootfs"),
}


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


# -- reading Markdown ---------------------------------------------------------------------------------


def code_blocks(text: str) -> Iterator[tuple[str, list[str]]]:
    """``(info string, lines)`` of every fenced block and every 4-space-indented block."""
    lines = text.splitlines()
    i = 0
    previous_blank = True
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(```+|~~~+)\s*(\S*)", line)
        if fence:
            marker, info = fence.group(1), fence.group(2)
            j = i + 1
            while j < len(lines) and not lines[j].startswith(marker):
                j += 1
            yield info, lines[i + 1 : j]
            i, previous_blank = j + 1, False
            continue
        if line.startswith("    ") and line.strip() and previous_blank:
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            yield "", [entry[4:] for entry in lines[i:j]]
            i, previous_blank = j, True
            continue
        previous_blank = not line.strip()
        i += 1


def prose(text: str) -> str:
    """The text without its code blocks (inline code stays)."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    previous_blank = True
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(```+|~~~+)", line)
        if fence:
            j = i + 1
            while j < len(lines) and not lines[j].startswith(fence.group(1)):
                j += 1
            i, previous_blank = j + 1, False
            out.append("")
            continue
        if line.startswith("    ") and line.strip() and previous_blank:
            out.append("")
            i += 1
            continue
        previous_blank = not line.strip()
        out.append(line)
        i += 1
    return "\n".join(out)


def inline_code(text: str) -> list[str]:
    """Every inline code span of the prose, line breaks inside it read as spaces."""
    spans = []
    for paragraph in re.split(r"\n\s*\n", prose(text)):
        spans += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", paragraph)]
    return spans


def links(text: str) -> list[str]:
    """Targets of every Markdown link and image outside code."""
    without_code = re.sub(r"`[^`]*`", "", prose(text))
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", without_code)


def anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a page."""
    found: dict[str, int] = {}
    out = set()
    for line in prose(text).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        n = found.get(slug, 0)
        found[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def shown_commands(text: str) -> list[str]:
    """Every ``orchestrator ...`` command of the code blocks, as the shell would run it: ``$ `` prompts,
    ``\\`` continuations, trailing ``# comments`` and ``VAR=value`` prefixes taken off, ``&&`` and ``;``
    chains split."""
    commands = []
    for _info, block in code_blocks(text):
        logical: list[str] = []
        pending = ""
        for line in block:
            line = pending + line.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            logical.append(line)
        for line in logical:
            line = re.sub(r"^\$\s+", "", line)
            for part in re.split(r"\s*(?:&&|\|\||;)\s*", line):
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    continue
                while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                    words = words[1:]
                if words and words[0] == "orchestrator":
                    commands.append(shlex.join(words))
    return commands


# -- the real parser ----------------------------------------------------------------------------------


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """No abbreviations, here and in every subparser: the docs show flags as they are spelled."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _strict(sub)
    return parser


def _subcommand(words: list[str]) -> str | None:
    return next((w for w in words if not w.startswith("-")), None)


def parse_error(command: str) -> str | None:
    """None when ``command`` (``orchestrator ...``) parses with the CLI's parser, else argparse's message."""
    words = shlex.split(command)[1:]
    name = _subcommand(words)
    parser = _strict(build_parser(name if name in COMMANDS else None))
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(words)
    except SystemExit as exc:
        if exc.code == 0 and words in (["--version"], ["--help"]):
            return None
        return stderr.getvalue().strip() or f"exit {exc.code}"
    if args.command is None:
        return "no command"
    return None


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def unknown_flags(synopsis: str) -> list[str]:
    """The flags of an inline ``orchestrator CMD [--flag X] ...`` synopsis its command does not have
    (its own options and its subcommands' together); a command that does not exist is one entry."""
    words = synopsis.replace("\\|", " ").replace("|", " ").replace("[", " ").replace("]", " ").split()[1:]
    if "--" in words:
        words = words[: words.index("--")]  # the script's own arguments
    name = _subcommand(words)
    if name is None:
        root = _options(build_parser(None))
        return [w for w in words if w.startswith("-") and w.split("=")[0] not in root]
    if name not in COMMANDS:
        return [name]
    parser = build_parser(name)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    known = _options(sub) | _options(parser)
    return [w for w in words if re.match(r"^--?[A-Za-z]", w) and w.split("=")[0] not in known]


def _defined(parts: list[str]) -> bool:
    """Whether a dotted ``orchestrator.`` name is a module of the repository, or a name its deepest
    module's source mentions (read as files: nothing imported)."""
    for n in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:n])
        source = next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)
        if source is not None:
            rest = parts[n:]
            return not rest or re.search(rf"\b{rest[0]}\b", source.read_text()) is not None
    return False


# -- the tests ----------------------------------------------------------------------------------------


def test_the_readme_is_a_short_start() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move reference text to docs/"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    targets = {(REPO / t.split("#")[0]).resolve() for t in links(README.read_text()) if "://" not in t}
    assert DOCS.is_dir() and list(DOCS.glob("*.md"))
    missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in targets]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_page_starts_with_its_title_and_a_one_line_purpose() -> None:
    for page in DOCS.glob("*.md"):
        head = page.read_text().splitlines()[:4]
        assert head[0].startswith("# ") and head[1] == "" and head[2] and head[3] == "", (page.name, head)


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_relative_links_images_and_anchors_resolve(page: Path) -> None:
    bad = []
    for target in links(page.read_text()):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            bad.append(f"{target}: no heading with that anchor")
    assert not bad, bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_paths_and_names_in_backticks_exist(page: Path) -> None:
    bad = []
    for span in inline_code(page.read_text()):
        a_path = span.startswith(REPO_TOPS) and re.fullmatch(r"[\w./-]+", span) and span not in USER_PATHS
        if a_path and not (REPO / span).exists():
            bad.append(span)
        dotted = re.match(r"^orchestrator(?:\.[A-Za-z_]\w*)+", span)
        if dotted and not _defined(dotted.group(0).split(".")):
            bad.append(span)
    assert not bad, f"{page.name} names what the repository does not have: {bad}"


def test_every_command_shown_parses_with_the_cli() -> None:
    shown = {page.name: shown_commands(page.read_text()) for page in pages()}
    failures = [
        f"{name}: {cmd}\n    {err}"
        for name, cmds in shown.items()
        for cmd in cmds
        if (err := parse_error(cmd))
    ]
    assert not failures, "\n".join(failures)
    # the extraction finds what is there: the quick start's seven, and the pages' own
    assert sum(len(c) for c in shown.values()) >= 20, shown
    assert "orchestrator resume local-2 --wait" in shown["README.md"]
    assert any(c.startswith("orchestrator export") for c in shown["export.md"]), shown["export.md"]
    assert any(c.startswith("orchestrator status") for c in shown["laptop.md"]), shown["laptop.md"]


def test_every_flag_of_an_inline_synopsis_exists() -> None:
    failures = []
    for page in pages():
        for span in inline_code(page.read_text()):
            if span.startswith("orchestrator ") and (unknown := unknown_flags(span)):
                failures.append(f"{page.name}: `{span}`: {unknown}")
    assert not failures, "\n".join(failures)


def all_flags() -> set[str]:
    """Every option string of every command (each command's module imported: none imports torch)."""
    return set().union(*(_options(build_parser(name)) for name in COMMANDS))


def test_every_flag_named_in_the_text_exists() -> None:
    """A flag the prose names on its own (`--hang-timeout S`, `--fsdp-version 1|2`) is some command's."""
    known = all_flags() | FOREIGN_FLAGS
    failures = []
    for page in pages():
        for span in inline_code(page.read_text()):
            flag = re.match(r"^--?[A-Za-z][\w-]*", span)
            if flag and flag.group(0) not in known:
                failures.append(f"{page.name}: `{span}`")
    assert not failures, "no command has these flags:\n" + "\n".join(failures)


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """A flag that does not exist, an abbreviation, a bad choice and a missing positional are caught;
    the extraction reads prompts, comments, variables, continuations and both kinds of block."""
    assert parse_error("orchestrator submit --profile local -- train/train.py") is None
    assert "--no-such-flag" in (parse_error("orchestrator submit --no-such-flag -- train/train.py") or "")
    assert parse_error("orchestrator submit --prof local -- train/train.py") is not None
    assert parse_error("orchestrator submit --strategy fulshard -- train/train.py") is not None
    assert parse_error("orchestrator remote install") is not None
    assert parse_error("orchestrator no-such-command") is not None
    assert unknown_flags("orchestrator logs JOB [-f] [--node N] [--no-such-flag]") == ["--no-such-flag"]
    assert unknown_flags("orchestrator logs JOB [-f] [--node N] -- --anything") == []
    assert unknown_flags("orchestrator frobnicate JOB") == ["frobnicate"]
    assert "--hang-timeout" in all_flags() and "--no-such-flag" not in all_flags()

    text = "\n".join(
        [
            "Text `orchestrator cancel JOB` here.",
            "",
            "    orchestrator wait JOB --timeout 20     # a comment",
            "    $ ORCHESTRATOR_LOGIN=x orchestrator status",
            "",
            "```bash",
            "orchestrator submit --profile local \\",
            '    --nodes 2 -- train/train.py --lr "3e-4"  # another',
            "cd x && orchestrator list --json",
            "echo orchestrator submit",
            "```",
            "",
            "```python",
            "orchestrator.submit(profile='local')",
            "```",
        ]
    )
    assert shown_commands(text) == [
        "orchestrator wait JOB --timeout 20",
        "orchestrator status",
        "orchestrator submit --profile local --nodes 2 -- train/train.py --lr 3e-4",
        "orchestrator list --json",
    ]
    assert inline_code(text) == ["orchestrator cancel JOB"]
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[x](missing.md) ![y](page.md#title) [z](#nowhere)\n")
    assert links(page.read_text()) == ["missing.md", "page.md#title", "#nowhere"]
    assert anchors(page.read_text()) == {"title"}
