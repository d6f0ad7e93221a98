"""Request bodies sent with a ``Content-Encoding``: ``gzip`` and ``deflate`` are decoded here, within the body limit;
any other encoding is refused with an OpenAI error body.

The gateway's server does not decode bodies itself (``auto_decompress=False``, :func:`gateway.app.app_runner`):
aiohttp's decoding answers an encoding it lacks a library for (``br``, ``zstd``) with a plain-text 400 before any
handler runs, and a body that is not what its header says with an unhandled exception (a 500, or a dropped
connection).
"""

from __future__ import annotations

import zlib

from gateway.errors import APIError, BodyTooLarge

_SUPPORTED = ("gzip", "deflate")
_ALIASES = {"x-gzip": "gzip"}  # RFC 9110 8.4.1.3: a recipient should take x-gzip as gzip
_GZIP_WBITS = zlib.MAX_WBITS | 16
MAX_GZIP_MEMBERS = 1000  # gzip bodies of several members are valid (RFC 1952); many tiny ones only cost CPU
_IN_BYTES = 1 << 16
_OUT_BYTES = 1 << 18


def coding_of(header_values: list[str]) -> str | None:
    """The coding a request's ``Content-Encoding`` header(s) name (lower-cased, aliases resolved; ``identity``
    dropped); None: none. Checked before the body is read.

    Raises:
        APIError: 415 ``unsupported_media_type`` (as for a Content-Type), param ``Content-Encoding``: a coding other
            than ``gzip`` or ``deflate``, or more than one.
    """
    named = (c.strip().lower() for value in header_values for c in value.split(","))
    codings = [_ALIASES.get(c, c) for c in named if c and c != "identity"]
    if len(codings) > 1 or any(c not in _SUPPORTED for c in codings):
        raise APIError(415, f"Content-Encoding {', '.join(codings)!r} is not supported: send the body as it is, or as one of "
                            f"gzip, deflate", param="Content-Encoding", code="unsupported_media_type")
    return codings[0] if codings else None


def decode(coding: str, raw: bytes, limit_bytes: int) -> bytes:
    """``raw`` decoded from ``coding``: ``gzip`` (one member or several, RFC 1952), or ``deflate`` (zlib-wrapped, or
    raw as some clients send it). CPU-bound: the caller runs it off the event loop.

    Raises:
        BodyTooLarge: the decoded body passes ``limit_bytes`` (found after at most ``limit_bytes`` + 1 decoded bytes).
        APIError: 400, param ``Content-Encoding``: ``raw`` is not whole data of ``coding``.
    """
    attempts = (_GZIP_WBITS,) if coding == "gzip" else (zlib.MAX_WBITS, -zlib.MAX_WBITS)
    errors = []
    for wbits in attempts:
        try:
            return _inflate(raw, wbits, limit_bytes)
        except zlib.error as err:
            errors.append(err)
    # the first format's error: deflate as most clients send it, zlib-wrapped
    raise APIError(400, f"request body is not valid {coding} data (Content-Encoding: {coding}): {errors[0]}", param="Content-Encoding")


def _inflate(raw: bytes, wbits: int, limit_bytes: int) -> bytes:
    """``raw`` inflated with ``wbits`` (zlib's), a gzip member after another while data follows one (at most
    ``MAX_GZIP_MEMBERS``). Input goes in ``_IN_BYTES`` at a time and output comes ``_OUT_BYTES`` at most a call, so
    no step copies much or holds the interpreter long (the event loop runs beside it).

    Raises:
        BodyTooLarge: as :func:`decode`.
        zlib.error: ``raw`` is not whole data of that format, or has too many gzip members.
    """
    view = memoryview(raw)
    pos = 0  # raw before this was taken as input
    pending: bytes | memoryview = b""  # input taken and not yet consumed
    out = bytearray()
    for _ in range(MAX_GZIP_MEMBERS):
        decoder = zlib.decompressobj(wbits)
        while not decoder.eof:
            if not pending:
                if pos == len(view):
                    break
                pending, pos = view[pos:pos + _IN_BYTES], min(len(view), pos + _IN_BYTES)
            out += decoder.decompress(pending, min(_OUT_BYTES, limit_bytes + 1 - len(out)))  # never 0 (unlimited)
            if len(out) > limit_bytes:
                raise BodyTooLarge(limit_bytes, None)
            pending = decoder.unconsumed_tail
        if not decoder.eof:
            raise zlib.error("the compressed data ends early")
        pending = decoder.unused_data
        if not pending and pos == len(view):
            return bytes(out)
        if wbits != _GZIP_WBITS:
            raise zlib.error(f"{len(pending) + len(view) - pos} bytes follow the end of the compressed data")
    raise zlib.error(f"more than {MAX_GZIP_MEMBERS} gzip members")
