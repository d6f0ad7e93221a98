"""SGLang 0.5.23's KV cache event stream on the wire: its ``--kv-events-config``, frames, replay, decoding.

Read from SGLang 0.5.23's ``srt/disaggregation/kv_events.py`` (``ZmqEventPublisher``,
``KVEventsConfig``, the event structs) and ``srt/mem_cache/events.py`` (what the
radix cache records):

* ``--kv-events-config`` is JSON of :class:`KVEventsConfig`; ``publisher: zmq``
  turns publishing on. The PUB socket binds when ``bind`` is true or the
  endpoint is a wildcard (``*``, ``0.0.0.0``, ``::``), ipc or inproc, and
  connects otherwise; the replay ROUTER always binds.
* Every scheduler step that changed the cache publishes one batch as a ZMQ
  multipart message ``[topic, seq, payload]``: ``seq`` is 8 bytes big-endian,
  0, 1, 2, ... from the publisher's start; ``payload`` is msgpack of
  ``EventBatch``, an array ``[ts, events, attn_dp_rank]``, each event a map
  tagged by ``type`` (``BlockStored``: ``block_hashes``, ``parent_block_hash``,
  ``token_ids``, ``block_size``, ``lora_id``, optional ``medium`` and others;
  ``BlockRemoved``: ``block_hashes``, ``medium``; ``AllBlocksCleared``). Optional
  fields left at None are omitted. Hashes are signed 64-bit; the first batch of
  a fresh cache starts with ``AllBlocksCleared`` (``RadixCache.reset``).
* Replay: a DEALER sends ``[b"", start seq]`` (8 bytes big-endian) to the
  ROUTER; it answers ``[b"", topic, seq, payload]`` for every batch still in its
  buffer (the last ``buffer_steps``) with seq >= start, then
  ``[b"", b"", END_SEQ, b""]``, END_SEQ being -1 as 8 signed bytes.
* Pages: one ``BlockStored`` hash per page of ``--page-size`` tokens (the tree
  keys are page-aligned); consecutive stores along one path are merged into
  one event. Events of another tier (``medium`` other than ``GPU``, e.g. the
  hierarchical cache's host copies) say nothing about what a prefill reuses
  and are dropped by :func:`decode_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec
from pydantic import BaseModel, ConfigDict

from policies.exact_prefix import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)
GPU_MEDIUM = "GPU"


class KVEventsConfig(BaseModel):
    """``--kv-events-config`` (SGLang 0.5.23's ``KVEventsConfig``; defaults as there)."""

    model_config = ConfigDict(extra="forbid")

    publisher: Literal["null", "zmq"] = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    format: Literal["default", "dynamo"] = "default"

    def binds(self) -> bool:
        """Whether the PUB socket binds ``endpoint`` (else it connects), as SGLang decides."""
        if self.bind is not None:
            return self.bind
        e = self.endpoint
        return "*" in e or "::" in e or "0.0.0.0" in e or e.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True)
class KVEventSource:
    """Where an engine publishes: ``endpoint`` (connected to), ``replay_endpoint`` (None: no replay), ``topic``,
    and its page size ``page_tokens`` (SGLang ``--page-size``)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    page_tokens: int = 1


def loopback_publisher(port: int, replay_port: int) -> KVEventsConfig:
    """The ``--kv-events-config`` laps gives an engine it starts: PUB bound on 127.0.0.1:``port``, replay on ``replay_port``."""
    return KVEventsConfig(publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}", bind=True,
                          replay_endpoint=f"tcp://127.0.0.1:{replay_port}")


class _BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class _BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None


class _AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    """The whole cache was emptied (``/flush_cache``, a role switch): the event carries no field but its tag."""


class _EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]
    attn_dp_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_EventBatch)


def encode_batch(ts: float, events: list[KVEvent]) -> bytes:
    """The msgpack payload of one batch of ``events`` at ``ts`` (Unix seconds), as SGLang encodes it (GPU tier, rank 0)."""
    wire: list[_BlockStored | _BlockRemoved | _AllBlocksCleared] = []
    for e in events:
        if isinstance(e, BlockStored):
            wire.append(_BlockStored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, None, GPU_MEDIUM))
        elif isinstance(e, BlockRemoved):
            wire.append(_BlockRemoved(list(e.block_hashes), GPU_MEDIUM))
        else:
            wire.append(_AllBlocksCleared())
    return _encoder.encode(_EventBatch(ts, wire, 0))


def decode_batch(payload: bytes) -> list[KVEvent]:
    """The events of one batch's payload, other tiers than the GPU's dropped.

    Raises:
        ValueError: the payload is not an SGLang event batch (msgspec's message says where).
    """
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as err:
        raise ValueError(f"not a KV event batch: {err}") from None
    events: list[KVEvent] = []
    for e in batch.events:
        if isinstance(e, _AllBlocksCleared):
            events.append(AllBlocksCleared())
        elif e.medium not in (None, GPU_MEDIUM):
            continue
        elif isinstance(e, _BlockStored):
            events.append(BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size))
        else:
            events.append(BlockRemoved(e.block_hashes))
    return events


def decode_seq(raw: bytes) -> int:
    """A frame's sequence number (8 bytes big-endian, signed so that END_SEQ is -1).

    Raises:
        ValueError: ``raw`` is not 8 bytes.
    """
    if len(raw) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)
