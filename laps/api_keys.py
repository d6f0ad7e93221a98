"""Client API keys (``gateway.api_keys``): kept as SHA-256 digests, each with the label metrics count it under.

A key file has one key a line: ``[sha256:]<64 hex digits of SHA-256(key)> [label]``; blank lines, whole-line
``#`` comments and a ``#`` comment after a key (after a space) are skipped, so
``printf %s "$KEY" | sha256sum >> keys.txt`` adds a key (its ``-`` is no label).
A key without a label is counted as ``key-<first 8 hex digits of its digest>``; the key itself is never stored.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

_COMMENT = re.compile(r"(?:^|\s)#.*")  # from a '#' that starts the line or follows a space
_LINE = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})(?:\s+(\S+))?\s*$")


def key_digest(key: str) -> str:
    """SHA-256 of ``key`` (UTF-8), as 64 lowercase hex digits."""
    return hashlib.sha256(key.encode()).hexdigest()


def default_label(digest: str) -> str:
    """The metrics label of a key with no label of its own."""
    return f"key-{digest[:8]}"


def parse_key_file(text: str, source: str) -> dict[str, str]:
    """``{digest: label}`` of a key file's ``text`` (see the module docstring).

    Raises:
        ValueError: a line is not a digest (the message names ``source`` and the line number), or the file holds no key.
    """
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = _COMMENT.sub("", line).strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{source} line {n}: expected '[sha256:]<64 hex digits> [label]' (the SHA-256 of a key, not the key)")
        digest, label = match.group(1).lower(), match.group(2)
        keys[digest] = label if label not in (None, "-") else default_label(digest)
    if not keys:
        raise ValueError(f"{source}: no key in the file")
    return keys


def load_keys(keys: list[str] | Path) -> dict[str, str]:
    """``{digest: label}`` of ``gateway.api_keys``: a list of keys, or the path of a key file.

    Raises:
        ValueError: the file cannot be read or is malformed.
    """
    if isinstance(keys, Path):
        try:
            text = keys.read_text()
        except OSError as err:
            raise ValueError(f"{keys}: cannot read the API key file: {err.strerror}") from None
        return parse_key_file(text, str(keys))
    return {key_digest(k): default_label(key_digest(k)) for k in keys}
