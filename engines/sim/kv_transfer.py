"""KV-cache transfer from prefill to decode engines over shared links: pure, no I/O, clock passed in.

In a prefill–decode (PD) disaggregated deployment a prefill engine computes a
request's KV cache and sends it to a decode engine (SGLang's
``--disaggregation-transfer-backend``: mooncake, nixl, …). This module prices
that hand-off:

* **Bytes.** A request's KV is ``tokens · kv_bytes_per_token``, split over the
  tensor-parallel ranks, each with its own link (:func:`kv_transfer_bytes`), where
  ``kv_bytes_per_token = layers · 2 · kv_heads · head_dim · dtype_bytes``
  (:attr:`engines.sim.latency.ModelSpec.kv_bytes_per_token`; Qwen2.5-7B
  57,344 B). The whole prompt's KV moves, cached prefix included: SGLang's
  decode engines keep no prefix cache by default, so they need all of it.
* **Links** (:data:`LINKS`): each engine has one egress and one ingress port of
  the link's bandwidth. A transfer from engine ``s`` to engine ``d`` crosses
  ``s``'s egress and ``d``'s ingress.
* **Sharing.** Concurrent transfers share ports max-min fairly (progressive
  filling, the fluid model of TCP and of RDMA queue pairs under congestion
  control): repeatedly, the most contended port splits its remaining capacity
  equally among its unfixed transfers, which are then fixed at that rate. Rates
  are recomputed whenever a transfer starts, ends or is cancelled, so a
  transfer's time is exact under the fluid model. An AWD batch of ``n``
  requests leaving one prefill engine at once therefore shares that engine's
  egress: ``n`` equal transfers all end after ``n`` solo times (the burst of
  the LAPS paper's open question D2). ``shared=False`` gives every transfer
  the full bandwidth (no contention), the reference the burst is measured
  against.

Not modelled: per-transfer setup latency (the bootstrap handshake, RDMA
registration), the transfer pipelining with chunked prefill (SGLang sends KV
chunk by chunk; here it starts when the prefill ends), and the node's PCIe/NIC
topology (ports are independent).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One interconnect: ``bandwidth_bytes_per_s`` per port and direction, and where the figure comes from."""

    name: str
    bandwidth_bytes_per_s: float
    source: str


LINKS: dict[str, LinkSpec] = {
    "nvlink": LinkSpec("nvlink", 450e9, "H200/H100 NVLink 4: 900 GB/s per GPU, both directions together (NVIDIA datasheet)"),
    "infiniband": LinkSpec("infiniband", 50e9, "one NDR InfiniBand port per GPU (ConnectX-7): 400 Gb/s = 50 GB/s"),
    "tcp": LinkSpec("tcp", 12.5e9, "100 Gb Ethernet with TCP: 100 Gb/s line rate = 12.5 GB/s"),
}
"""Link presets by name; bandwidths are line rates per port and direction (real transfers reach less)."""


def kv_transfer_bytes(kv_bytes_per_token: int, tokens: int, tp_size: int = 1) -> float:
    """Bytes one tensor-parallel rank sends over its own link for ``tokens`` tokens: ``tokens · kv_bytes_per_token / tp_size``.

    Under tensor parallelism each of the ``tp_size`` ranks holds ``1/tp_size``
    of the KV heads and sends its slice over its own link, all ranks at once,
    so the hand-off lasts as long as one rank's share takes. Both the live
    simulated engine (:mod:`engines.sim.server`) and the virtual PD run
    (:mod:`loadgen.virtual_pd`) price transfers with this.

    Raises:
        ValueError: a negative token count or a ``tp_size`` below 1.
    """
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    return tokens * kv_bytes_per_token / tp_size


@dataclass(slots=True)
class Transfer:
    """One KV transfer in flight or done. Times in seconds on the caller's clock, sizes in bytes.

    ``rate_bytes_per_s`` is its current share of the links (0 once done);
    ``end_s`` is set when it completes. ``solo_s`` is what it would take alone on an idle link.
    """

    tid: str
    src: str
    dst: str
    nbytes: float
    start_s: float
    solo_s: float
    remaining: float
    rate_bytes_per_s: float = 0.0
    end_s: float | None = None

    @property
    def inflation(self) -> float:
        """Transfer time over solo time (1.0: no contention); needs ``end_s``; 1.0 for an empty transfer."""
        assert self.end_s is not None, "inflation of a transfer still in flight"
        return (self.end_s - self.start_s) / self.solo_s if self.solo_s > 0 else 1.0


_EPS_S = 1e-12


class KvTransferNetwork:
    """Transfers between engines over per-engine ports, shared max-min fairly (see the module doc).

    Drive it with :meth:`start`, :meth:`cancel` and :meth:`pop_done`, always
    with a non-decreasing ``now``; :meth:`next_done_s` says when to call
    :meth:`pop_done` next.

    Raises:
        ValueError: a non-positive bandwidth.
    """

    def __init__(self, bandwidth_bytes_per_s: float, shared: bool = True) -> None:
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {bandwidth_bytes_per_s}")
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.shared = shared
        self._active: dict[str, Transfer] = {}
        self._done: list[Transfer] = []  # ended, not yet returned by pop_done
        self._now = 0.0

    @property
    def in_flight(self) -> int:
        """Transfers started and not yet done or cancelled."""
        return len(self._active)

    def start(self, tid: str, src: str, dst: str, nbytes: float, now: float) -> Transfer:
        """Begin sending ``nbytes`` from engine ``src`` to engine ``dst`` at ``now``; the transfer object.

        Raises:
            ValueError: a duplicate ``tid``, negative ``nbytes``, or ``now`` before the last call's.

        Transfers that ended before ``now`` wait for :meth:`pop_done`.
        """
        if tid in self._active:
            raise ValueError(f"transfer {tid!r} is already in flight")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._advance(now)
        t = Transfer(tid, src, dst, float(nbytes), now, nbytes / self.bandwidth_bytes_per_s, float(nbytes))
        self._active[tid] = t
        self._rebalance()
        return t

    def cancel(self, tid: str, now: float) -> Transfer | None:
        """Stop transfer ``tid`` at ``now`` (its bandwidth goes to the others); None when it is not in flight.

        Raises:
            ValueError: ``now`` before the last call's.
        """
        self._advance(now)
        if tid not in self._active:
            return None
        t = self._active.pop(tid)
        t.rate_bytes_per_s = 0.0
        self._rebalance()
        return t

    def next_done_s(self) -> float | None:
        """When the next transfer ends at the current rates (None: none in flight or waiting for :meth:`pop_done`)."""
        if self._done:
            return self._done[0].end_s
        ends = [self._now + t.remaining / t.rate_bytes_per_s if t.rate_bytes_per_s > 0 else self._now
                for t in self._active.values()]
        return min(ends, default=None)

    def pop_done(self, now: float) -> list[Transfer]:
        """Advance to ``now``; the transfers that ended by then, in end order (ties: start order).

        Raises:
            ValueError: ``now`` before the last call's.
        """
        self._advance(now)
        done, self._done = self._done, []
        return done

    # ---- internals ----------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Progress every transfer to ``now``, moving those that end by then to the done list."""
        if now < self._now - _EPS_S:
            raise ValueError(f"time went backwards: {now} < {self._now}")
        while self._active:
            t_next = min(self._now + t.remaining / t.rate_bytes_per_s if t.rate_bytes_per_s > 0 else self._now
                         for t in self._active.values())
            if t_next > now + _EPS_S:
                break
            self._progress(max(t_next, self._now))
            finished = [t for t in self._active.values() if t.remaining <= t.rate_bytes_per_s * _EPS_S or t.remaining <= 0]
            if not finished:  # rounding: the earliest one is due now
                finished = [min(self._active.values(), key=lambda t: t.remaining / t.rate_bytes_per_s)]
            for t in finished:
                del self._active[t.tid]
                t.remaining, t.rate_bytes_per_s, t.end_s = 0.0, 0.0, self._now
                self._done.append(t)
            self._rebalance()
        self._progress(max(now, self._now))

    def _progress(self, now: float) -> None:
        dt = now - self._now
        if dt > 0:
            for t in self._active.values():
                t.remaining = max(0.0, t.remaining - t.rate_bytes_per_s * dt)
        self._now = max(self._now, now)

    def _rebalance(self) -> None:
        """Max-min fair rates by progressive filling over the egress/ingress ports."""
        bw = self.bandwidth_bytes_per_s
        if not self.shared:
            for t in self._active.values():
                t.rate_bytes_per_s = bw
            return
        capacity: dict[tuple[str, str], float] = {}
        users: dict[tuple[str, str], list[Transfer]] = {}
        for t in self._active.values():
            for port in (("out", t.src), ("in", t.dst)):
                capacity[port] = bw
                users.setdefault(port, []).append(t)
        unfixed = set(self._active)
        while unfixed:
            share, port = min(((capacity[p] / len(us), p) for p, us in users.items() if us), key=lambda x: x[0])
            for t in list(users[port]):
                t.rate_bytes_per_s = share
                unfixed.discard(t.tid)
                for p in (("out", t.src), ("in", t.dst)):
                    capacity[p] -= share
                    users[p].remove(t)
