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

SUPPORTED = ("gzip", "deflate", "identity")
_CHUNK_BYTES = 1 << 20  # input fed to the decoder at a time: its output is checked against the limit as it grows


def encodings_of(header_values: list[str]) -> list[str]:
    """The codings a request's ``Content-Encoding`` header(s) name, in the order applied, lower-cased, without
    ``identity`` (``[]``: none)."""
    codings = [c.strip().lower() for value in header_values for c in value.split(",")]
    return [c for c in codings if c and c != "identity"]


def check_encodings(codings: list[str]) -> None:
    """Refuse codings the gateway does not decode, before the body is read.

    Raises:
        APIError: 415 ``unsupported_media_type`` (as for a Content-Type), param ``Content-Encoding``: a coding other
            than ``gzip`` or ``deflate``, or more than one.
    """
    if len(codings) > 1 or any(c not in SUPPORTED for c in codings):
        raise APIError(415, f"Content-Encoding {', '.join(codings)!r} is not supported: send the body as it is, or as one of "
                            f"gzip, deflate", param="Content-Encoding", code="unsupported_media_type")


def decode(coding: str, raw: bytes, limit_bytes: int) -> bytes:
    """``raw`` decoded from ``coding`` (``gzip``, or ``deflate``: zlib-wrapped, or raw as some clients send it).

    Raises:
        BodyTooLarge: the decoded body passes ``limit_bytes``.
        APIError: 400, param ``Content-Encoding``: ``raw`` is not whole data of ``coding``.
    """
    if coding == "gzip":
        attempts = (zlib.MAX_WBITS | 16,)
    else:
        attempts = (zlib.MAX_WBITS, -zlib.MAX_WBITS)
    for wbits in attempts:
        try:
            return _inflate(raw, wbits, limit_bytes)
        except zlib.error as err:
            error = err
    raise APIError(400, f"request body is not valid {coding} data (Content-Encoding: {coding}): {error}", param="Content-Encoding")


def _inflate(raw: bytes, wbits: int, limit_bytes: int) -> bytes:
    decoder = zlib.decompressobj(wbits)
    out = bytearray()
    for start in range(0, len(raw), _CHUNK_BYTES):
        chunk = raw[start:start + _CHUNK_BYTES]
        while chunk:
            out += decoder.decompress(chunk, limit_bytes + 1 - len(out))
            if len(out) > limit_bytes:
                raise BodyTooLarge(limit_bytes, None)
            chunk = decoder.unconsumed_tail
    out += decoder.flush()
    if not decoder.eof:
        raise zlib.error("the compressed data ends early")
    if len(out) > limit_bytes:
        raise BodyTooLarge(limit_bytes, None)
    return bytes(out)
