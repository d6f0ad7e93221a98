"""How deep JSON may nest where the gateway has to write it again.

The gateway reads request bodies with orjson (up to 1,024 levels of arrays and objects) and writes them to the engine
with orjson, which writes at most :data:`MAX_DEPTH` levels (``orjson.dumps`` raises ``TypeError: Recursion limit
reached`` past that); a tool call's arguments are printed by the chat template with ``json.dumps``, which stops near
Python's recursion limit (1,000). A body or an argument object nested deeper is refused up front, not failed later.
"""

from __future__ import annotations

import orjson

MAX_DEPTH = 254  # levels orjson 3 writes (measured: 254 nested objects written, 255 refused)


def too_deep(value: object, text: str | bytes) -> bool:
    """Whether ``value`` (parsed from ``text``) nests arrays and objects deeper than :data:`MAX_DEPTH` levels.

    Only a text with more than that many opening brackets can; only such a text is written to find out.
    """
    opening = ("{", "[") if isinstance(text, str) else (b"{", b"[")
    if text.count(opening[0]) + text.count(opening[1]) <= MAX_DEPTH:
        return False
    try:
        orjson.dumps(value)
    except TypeError:  # "Recursion limit reached"
        return True
    return False
