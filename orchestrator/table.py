"""Plain-text tables for the CLI (no dependency: rich would cost start-up time)."""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable, Mapping, Sequence
from json.encoder import encode_basestring_ascii
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
_SCALARS = frozenset({str, int, float, bool, type(None)})
_SCALARS_OR_LIST = _SCALARS | {list}


def _flat(obj: dict[str, Any]) -> bool:
    """Values all scalars or empty lists (``corrupt_checkpoints: []`` in every status row): the C
    encoder writes ``[]`` exactly as ``indent=2`` does, so such a mapping is still one C call. The
    type checks run at C speed; only a row holding a list looks at the lists themselves."""
    types = set(map(type, obj.values()))
    if types <= _SCALARS:
        return True
    return types <= _SCALARS_OR_LIST and not any(v for v in obj.values() if type(v) is list)


def _flat_rows(rows: Sequence[dict[str, Any]], level: int) -> str:
    """A list of non-empty flat mappings (``status --json``'s jobs) in one C encoder call.

    Encoded with the rows' own item separator, the list comes out as ``[{...},<sep>{...}]``; the
    row boundaries are then re-indented by plain replacement. That is exact because a real newline
    only ever comes from a separator (inside strings JSON writes ``\\n``), and with scalar values
    only ``},<newline>`` followed by the row indent and ``{`` is a row boundary.
    """
    row_pad, item_pad = "\n" + "  " * (level + 1), "\n" + "  " * (level + 2)
    text = _flat_encoder(level + 2)(rows)
    body = text[2:-2].replace("}," + item_pad + "{", row_pad + "}," + row_pad + "{" + item_pad)
    return "[" + row_pad + "{" + item_pad + body + row_pad + "}" + "\n" + "  " * level + "]"


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
        if all(type(v) is dict and v and _STR.issuperset(v) and _flat(v) for v in obj):
            return _flat_rows(obj, level)
        return "[" + ",".join(pad + "  " + _dumps(v, level + 1) for v in obj) + pad + "]"
    # Scalars, empty containers and anything unusual (non-str keys): the json module itself.
    # JSON text holds no raw newline, so re-indenting its lines is exact.
    return json.dumps(obj, indent=2).replace("\n", pad)
