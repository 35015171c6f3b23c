"""Writing Markdown safely: every user-provided string and every table cell goes through here.

Tokens, file names, model specs and other strings from the user or the tokenizer may hold ``|``
(``<|im_start|>``), line breaks, backticks, ``*``/``_``/``[`` or HTML (``<img onerror=...>``).
:func:`text` makes any string inert, one-line inline Markdown; :func:`table` builds a table from
cells that are all passed through it. No matplotlib, no torch: safe to import anywhere.
"""

from __future__ import annotations

from typing import Iterable, Sequence
from urllib.parse import quote

_SPECIAL = frozenset("\\`*_[]<>&|~$")
"""Characters with an inline meaning in CommonMark/GFM (escape, code, emphasis, links and images,
HTML and autolinks, entities, table cells, strikethrough, math). Text made by :func:`text` never
starts a line (it follows a label, or sits in a table cell), so block markers (``#``, ``-``,
``1.``, ``>`` at a line start) cannot take effect."""
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _visible(ch: str) -> str:
    """A control or line-separator character as a visible escape (``\\n``, ``\\x1b``, ``\\u2028``)."""
    if ch in _NAMED:
        return _NAMED[ch]
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def _is_control(ch: str) -> bool:
    o = ord(ch)
    return o < 0x20 or 0x7F <= o < 0xA0 or o in (0x2028, 0x2029, 0x85)


def text(s: object) -> str:
    """``s`` as literal inline Markdown on one line: the characters of :data:`_SPECIAL` are
    backslash-escaped (no emphasis, code, links, HTML, entities or table-cell breaks: ``|`` stays in
    its cell), and control characters and line breaks are shown as escapes (``\\n``, ``\\r``)."""
    out = []
    for ch in str(s):
        if _is_control(ch):
            out.extend("\\" + c if c in _SPECIAL else c for c in _visible(ch))
        elif ch in _SPECIAL:
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


def token(s: str) -> str:
    """A token string: :func:`text`, with leading and trailing spaces shown as ``␣`` (table cells
    and inline text would otherwise drop them; ``" the"`` and ``"the"`` are different tokens)."""
    core = s.strip(" ")
    lead = len(s) - len(s.lstrip(" "))
    trail = len(s) - len(s.rstrip(" ")) if core else 0
    return "␣" * lead + text(core) + "␣" * trail


def link(label: str, target: str) -> str:
    """``[label](target)`` with the label escaped and the target percent-encoded (a relative file name)."""
    return f"[{text(label)}](<{quote(str(target), safe='/')}>)"


def table(header: Sequence[object], rows: Iterable[Sequence[object]], align: str | None = None) -> list[str]:
    """A GitHub-flavoured Markdown table as lines. Every cell goes through :func:`text`, except
    cells already made here and marked :class:`Raw` (e.g. ``Raw(token(t))``). ``align``: one
    character per column, ``l``/``r``/``c`` (default all left)."""
    align = align or "l" * len(header)
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |",
             "|" + "|".join(rule[a] for a in align) + "|"]
    for row in rows:
        cells = list(row)
        if len(cells) != len(header):
            raise ValueError(f"table row has {len(cells)} cells, the header {len(header)}")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


class Raw(str):
    """Markdown already made safe by this module (``Raw(token(t) + " @3")``): not escaped again."""


def _cell(c: object) -> str:
    if isinstance(c, Raw):
        return str(c).replace("\r", " ").replace("\n", " ")   # never let a cell break its row
    return text(c)


def ranges(numbers: Iterable[int], dash: str = "–") -> str:
    """Whole numbers as ranges: ``[0, 1, 2, 5]`` -> ``"0–2, 5"`` (``"none"`` when empty)."""
    xs = sorted(numbers)
    if not xs:
        return "none"
    parts, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}" if start == prev else f"{start}{dash}{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(parts)
