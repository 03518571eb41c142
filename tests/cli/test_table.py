"""``dumps_indented`` (status --json, list --json) writes exactly what ``json.dumps(indent=2)`` writes."""

from __future__ import annotations

import enum
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.cli.table import dumps_indented

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
documents = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=6), children, max_size=5),
        st.dictionaries(st.one_of(st.integers(), st.booleans(), st.none()), children, max_size=3),
    ),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None, database=None)
@given(documents)
def test_same_bytes_as_json_dumps(document: Any) -> None:
    assert dumps_indented(document) == json.dumps(document, indent=2)


class Color(str, enum.Enum):
    RED = "red"


def test_status_shaped_document_and_odd_values() -> None:
    row = {"job_id": "1", "loss": 0.5, "eta_s": None, "stale": True, "name": 'é\n"x"', "n": float("nan")}
    doc = {
        "source": "squeue",
        "errors": [],
        "scheduler_calls": {"squeue": 1, "sacct": 0},
        "jobs": [row, {**row, "color": Color.RED, "t": (1, 2), "sub": {}, "big": 10**30}],
    }
    assert dumps_indented(doc) == json.dumps(doc, indent=2)
    assert dumps_indented([]) == "[]" and dumps_indented({}) == "{}"


def test_lists_of_flat_rows_in_one_piece() -> None:
    """The one-call path for lists of flat rows, with strings that look like row boundaries."""
    tricky = ["}", "},", "},\n      {", '"},{"', "{\n}", "\\", "\u2028"]
    rows = [{"i": i, "s": s, "f": i / 3, "n": None, "b": i % 2 == 0} for i, s in enumerate(tricky)]
    for doc in (rows, {"jobs": rows}, {"a": {"jobs": rows, "x": []}}, [rows, rows[:1]]):
        assert dumps_indented(doc) == json.dumps(doc, indent=2)
    mixed = [*rows, {}]  # an empty row sends the list down the general path
    assert dumps_indented(mixed) == json.dumps(mixed, indent=2)
    # status rows carry corrupt_checkpoints: [] (still the one-call path) or a non-empty list (not)
    with_lists = [{**r, "corrupt": []} for r in rows]
    for doc in (with_lists, {"jobs": with_lists}, [*with_lists, {**rows[0], "corrupt": [3, 5]}]):
        assert dumps_indented(doc) == json.dumps(doc, indent=2)


def test_rows_with_a_nested_mapping_are_encoded_in_runs() -> None:
    """status rows of running jobs carry ``liveness`` (a mapping, itself holding a mapping or None):
    the scalars around it go in runs, the mapping recursively; the text is still indent=2's."""
    tricky = ["}", "},", "},\n      {", '"},{"', "\\"]
    rows = [
        {
            "i": i,
            "s": s,
            "corrupt": [],
            "liveness": {
                "attempt": i,
                "silent_s": None if i % 2 else 1.5,
                "stragglers": {"rank": i, "x": [1]},
            }
            if i % 3
            else None,
            "after": {} if i == 2 else s,
            "last": i / 7,
        }
        for i, s in enumerate(tricky)
    ]
    for doc in (rows, {"jobs": rows}, [rows, {"x": rows[1]}]):
        assert dumps_indented(doc) == json.dumps(doc, indent=2)


def test_rows_with_holes_alike_and_unlike() -> None:
    """Rows alike in their keys (status's) fill their mappings and lists back in order: flat mappings
    written together, others alone; rows whose keys differ, or whose other keys hold a mapping, or a
    value equal to the stand-in string itself, still come out as indent=2 writes them."""
    from orchestrator.cli.table import _HOLE

    def row(i: int, **kw: Any) -> dict[str, Any]:
        return {
            "job_id": str(i), "name": "},\n        {", "loss": i / 7, "corrupt": [3, i] if i == 4 else [],
            "liveness": None if i == 3 else {"attempt": i, "silent_s": i / 3, "stragglers": None}, **kw,
        }  # fmt: skip

    rows = [row(i) for i in range(8)]
    rows[5]["liveness"]["stragglers"] = {"slowest_rank": 1, "flagged_ranks": [1]}
    rows[6] = {"liveness": rows[6]["liveness"], **row(6)}  # the same keys, in another order
    rows[7]["extra"] = {"a": 1}  # a mapping under a key the others do not have
    rows.append(row(8, liveness={}))
    rows.append(row(9, after={"x": [1, 2]}))
    for doc in (rows, {"jobs": rows}, rows[:3]):
        assert dumps_indented(doc) == json.dumps(doc, indent=2)
    hole = [row(0), row(1, name=_HOLE)]
    assert dumps_indented(hole) == json.dumps(hole, indent=2)
