"""Plain-text tables for the CLI (no dependency: rich would cost start-up time)."""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable, Mapping, Sequence
from json.encoder import encode_basestring_ascii
from operator import countOf
from typing import Any


def format_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str], headers: Sequence[str] | None = None
) -> str:
    heads = [h.upper() for h in (headers or columns)]
    cells = [["" if row.get(c) is None else str(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip()]
    for r in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def dumps_indented(obj: Any) -> str:
    """``json.dumps(obj, indent=2)``, byte for byte, several times faster on lists of flat dicts.

    With ``indent`` set, the json module falls back to its pure-Python encoder: that was ~60 ms of
    ``status --json`` over 1,000 jobs. A mapping whose values are all scalars has a constant
    indentation, so the C encoder can write it with the newline and indent as item separator;
    everything else is assembled here around such pieces (tests compare with json.dumps).
    """
    return _dumps(obj, 0)


_ENCODERS: dict[int, Callable[[Any], str]] = {}


def _flat_encoder(level: int) -> Callable[[Any], str]:
    """The C encoder writing a flat mapping whose items sit at ``level`` (built once per level).

    ``json.encoder.c_make_encoder`` directly: ``JSONEncoder.encode`` rebuilds it on every call,
    which costs more than encoding one row. Where it is missing or its signature differs, the
    public (slower, same output) route is used.
    """
    enc = _ENCODERS.get(level)
    if enc is None:
        item_sep = ",\n" + "  " * level
        try:
            c_enc = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
                None, None, encode_basestring_ascii, None, ": ", item_sep, False, False, True
            )

            def enc(obj: Any, _c: Any = c_enc) -> str:
                return "".join(_c(obj, 0))

            enc({"probe": 1.5})
        except (TypeError, AttributeError):
            enc = json.JSONEncoder(separators=(item_sep, ": ")).encode
        _ENCODERS[level] = enc
    return enc


_STR = frozenset({str})
_DICT = {dict}
_SCALARS = frozenset({str, int, float, bool, type(None)})
_SCALARS_OR_LIST = _SCALARS | {list}


def _flat(obj: dict[str, Any]) -> bool:
    """Values all scalars or empty lists (``corrupt_checkpoints: []`` in every status row): the C
    encoder writes ``[]`` exactly as ``indent=2`` does, so such a mapping is still one C call. The
    checks run at C speed: with only scalars and lists, the lists are all empty when as many values
    are lists as equal ``[]`` (no scalar does)."""
    values = obj.values()
    types = set(map(type, values))
    if types <= _SCALARS:
        return True
    return types <= _SCALARS_OR_LIST and countOf(map(type, values), list) == countOf(values, [])


def _reindent_rows(pieces: list[str], level: int) -> list[str]:
    """The pieces (split where values go back in) of a list of non-empty mappings written by the C
    encoder at ``level + 2``, re-indented as the rows of a list at ``level``.

    Encoded with the rows' own item separator, the list comes out as ``[{...},<sep>{...}]``; the
    row boundaries are then re-indented by plain replacement. That is exact because a real newline
    only ever comes from a separator (inside strings JSON writes ``\\n``), and with scalar values
    only ``},<newline>`` followed by the row indent and ``{`` is a row boundary. Piece by piece (a
    boundary never straddles a hole, which is a value inside a row), so the text is copied once
    here, not once per concatenation of the whole.
    """
    row_pad, item_pad = "\n" + "  " * (level + 1), "\n" + "  " * (level + 2)
    old, new = "}," + item_pad + "{", row_pad + "}," + row_pad + "{" + item_pad
    pieces = [p.replace(old, new) for p in pieces]
    pieces[0] = "[" + row_pad + "{" + item_pad + pieces[0][2:]
    pieces[-1] = pieces[-1][:-2] + row_pad + "}" + "\n" + "  " * level + "]"
    return pieces


#: Stands in for a row's mapping values while the rows are encoded in one piece (a string no real
#: value is expected to hold; if one does, the count of its occurrences tells and the slower route
#: is taken).
_HOLE = "\x00orchestrator.table hole\x00"
_HOLE_JSON = encode_basestring_ascii(_HOLE)


def _rows_with_mappings(rows: Sequence[dict[str, Any]], level: int) -> str | None:
    """A list of non-empty mappings some of whose values are lists or mappings (``status --json``'s
    rows: ``corrupt_checkpoints`` and ``liveness``) in a few C encoder calls, not several per row.

    Each value that is not a scalar is replaced by :data:`_HOLE`, the rows are written in one C
    encoder call (:func:`_reindent_rows`), the values that are non-empty flat mappings in one more
    (split at their boundaries as the rows are), any other value on its own, and each goes back into
    its hole, in order. Rows alike in their keys (all of status's) find their holes where the last
    such row had them, and one type check of the row says no other value needs one. None (the
    general route) when a key is not a string or a real value holds :data:`_HOLE`."""
    values: list[Any] = []
    holed = []
    keys: list[str] = []
    at: list[str] = []  # the keys that held a hole in the last row with these keys, in their order
    for row in rows:
        if list(row) != keys:  # checked once per run of rows with the same keys: all strings
            keys = list(row)
            if not _STR.issuperset(map(type, keys)):
                return None
            at = [k for k, v in row.items() if type(v) not in _SCALARS]
        copy = row.copy()
        for key in at:
            if type(copy[key]) not in _SCALARS:
                values.append(copy[key])
                copy[key] = _HOLE
        if not _SCALARS.issuperset(map(type, copy.values())):  # another key needs a hole here
            del values[len(values) - sum(copy[k] is _HOLE for k in at) :]
            at = [k for k, v in row.items() if type(v) not in _SCALARS]
            copy = row.copy()
            for key in at:
                values.append(copy[key])
                copy[key] = _HOLE
        holed.append(copy)
    text = _flat_encoder(level + 2)(holed)
    pieces = text.split(_HOLE_JSON) if values else [text]
    if len(pieces) != len(values) + 1:
        return None
    pieces = _reindent_rows(pieces, level)
    if not values:
        return pieces[0]
    pad, inner = "\n" + "  " * (level + 2), "\n" + "  " * (level + 3)
    is_flat = [type(v) is dict and v and _STR.issuperset(map(type, v)) and _flat(v) for v in values]
    flat = [v for v, f in zip(values, is_flat, strict=True) if f]
    # A boundary between two flat mappings is the only place "}," can meet the separator.
    texts = _flat_encoder(level + 3)(flat)[2:-2].split("}," + inner + "{") if flat else []
    if len(texts) != len(flat):
        return None
    filled = iter(texts)
    out = [pieces[0]]
    for value, f, piece in zip(values, is_flat, pieces[1:], strict=True):
        if f:
            out.append("{" + inner + next(filled) + pad + "}")
        else:
            out.append("[]" if type(value) is list and not value else _dumps(value, level + 2))
        out.append(piece)
    return "".join(out)


def _chunked_items(obj: dict[str, Any], level: int) -> list[str]:
    """The items of a mapping that is not flat (a status row with its ``liveness`` mapping): each run
    of scalar values (and empty lists) in one C encoder call, only the other values recursively.
    The encoder's item separator at ``level + 1`` is exactly the newline and indent that
    ``indent=2`` puts between two items, so a run comes out as those items would."""
    pad = "\n" + "  " * (level + 1)
    out: list[str] = []
    run: dict[str, Any] = {}
    for key, value in obj.items():
        if type(value) in _SCALARS or (type(value) is list and not value):
            run[key] = value
            continue
        if run:
            out.append(pad + _flat_encoder(level + 1)(run)[1:-1])
            run = {}
        out.append(pad + encode_basestring_ascii(key) + ": " + _dumps(value, level + 1))
    if run:
        out.append(pad + _flat_encoder(level + 1)(run)[1:-1])
    return out


def _dumps(obj: Any, level: int) -> str:
    if type(obj) in _SCALARS:  # exact types: a str/int subclass (an Enum) takes the json route below
        return _flat_encoder(0)(obj)
    pad = "\n" + "  " * level
    if type(obj) is list and obj and _SCALARS.issuperset(map(type, obj)):  # a command line
        return "[" + pad + "  " + _flat_encoder(level + 1)(obj)[1:-1] + pad + "]"
    if isinstance(obj, dict) and obj and _STR.issuperset(map(type, obj)):
        if _flat(obj):  # C-speed checks: one row is ~25 values
            return "{" + pad + "  " + _flat_encoder(level + 1)(obj)[1:-1] + pad + "}"
        return "{" + ",".join(_chunked_items(obj, level)) + pad + "}"
    if isinstance(obj, (list, tuple)) and obj:
        if set(map(type, obj)) == _DICT and all(obj):  # non-empty mappings (their keys: below)
            text = _rows_with_mappings(obj, level)
            if text is not None:
                return text
        return "[" + ",".join(pad + "  " + _dumps(v, level + 1) for v in obj) + pad + "]"
    # Scalars, empty containers and anything unusual (non-str keys): the json module itself.
    # JSON text holds no raw newline, so re-indenting its lines is exact.
    return json.dumps(obj, indent=2).replace("\n", pad)
