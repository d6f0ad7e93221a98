"""``--help`` text from a bench script's module docstring: its reStructuredText inline markup shown as plain text.

The bench scripts' docstrings are written for Sphinx-style readers (``code``, :func:`~pkg.mod.name`);
:func:`doc_parser` builds a script's parser from its docstring the way they all do, and :func:`plain_text`
turns that markup into what a terminal reader expects. It lives in the installed package (not in ``bench/``) so that
``python bench/NAME.py``, ``python -m bench.NAME`` and ``import bench.NAME`` all find it.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

# A role, :func:`target` (or :py:func:`target`), not inside a word or an inline literal.
_ROLE = re.compile(r"(?<![\w`]):(?:[A-Za-z]+:)?[A-Za-z]+:`([^`]+)`")
# A role's explicit title: `title <target>`.
_TITLED = re.compile(r"(.*?)\s*<[^<>]*>", re.DOTALL)
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


def _role_text(match: re.Match[str]) -> str:
    """What a role shows: its title, else the last name of a ``~`` target, else the whole target; in backticks."""
    target = match.group(1)
    titled = _TITLED.fullmatch(target)
    if titled and titled.group(1):
        return f"`{titled.group(1)}`"
    if target.startswith("~"):
        return f"`{target[1:].rsplit('.', 1)[-1]}`"
    return f"`{target}`"


def plain_text(rst: str) -> str:
    """Show reStructuredText's inline code markup as plain text.

    Args:
        rst: text with ``double-backtick`` literals and roles such as :func:`~a.b.c`.

    Returns:
        ``rst`` with each role shown as its text in single backticks (the target; for a target starting with
        ``~``, its last dotted name; for a role written ``title <target>``, the title) and each double-backtick
        literal in single backticks; every other character, line breaks and indentation included, as is.
    """
    return _LITERAL.sub(r"`\1`", _ROLE.sub(_role_text, rst))


def doc_parser(doc: str, *, split: bool = True, **kwargs: Any) -> argparse.ArgumentParser:
    """A bench script's parser, its description and epilog from its docstring (raw, markup as plain text).

    Args:
        doc: the script's ``__doc__``.
        split: True: the description is the docstring's first paragraph and the epilog the rest (none when
            there is no rest); False: the description is the whole docstring, and no epilog.
        **kwargs: passed on to :class:`argparse.ArgumentParser` (``prog=...``); an explicit ``epilog``
            replaces the one from the docstring (``epilog=None``: none), and ``formatter_class`` the default.

    Returns:
        The parser, by default with :class:`argparse.RawDescriptionHelpFormatter`: the docstring's lines as written.
    """
    description, _, rest = doc.partition("\n\n") if split else (doc, "", "")
    epilog = kwargs.pop("epilog", rest or None)
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return argparse.ArgumentParser(description=plain_text(description),
                                   epilog=None if epilog is None else plain_text(epilog), **kwargs)
