"""Discrete-time backlog executor of Wang, Ye, Zhou (arXiv 2508.06133, §2 model).

Time is counted in iterations. A request ``i`` admitted at boundary ``t`` runs in iterations
``t+1 .. t+o_i``; in its ``j``-th iteration it produces output token ``j`` and holds
``s_i + j`` KV tokens (prompt plus outputs so far); it finishes at ``t + o_i`` and frees its
memory after that iteration. A batch fits the KV budget ``M`` when the summed memory of all
running requests is at most ``M`` in every future iteration.

Admission is in a given order and stops at the first request that does not fit (no
skipping), which is Phase 2 of Sorted-F and also how FCFS and MC-SF admit. Everything here is
pure: lengths come in as integer arrays, time as iteration indices, no clock, no randomness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Orders the waiting requests; the executor admits from the head while memory allows.

    ``refresh_every``: iterations between calls when no request arrives (None: only call on
    arrivals). ``queue(t, waiting)`` receives the waiting request indices in arrival order
    and returns them reordered (a permutation of ``waiting``).
    """

    refresh_every: int | None

    def queue(self, t: int, waiting: Sequence[int]) -> list[int]: ...


@dataclass(frozen=True)
class StaticOrder:
    """A fixed admission order (offline Sorted-F, Sorted-LP, FCFS, MC-SF): rank = position."""

    order: Sequence[int]
    refresh_every: int | None = None

    def queue(self, t: int, waiting: Sequence[int]) -> list[int]:
        rank = {rid: pos for pos, rid in enumerate(self.order)}
        return sorted(waiting, key=rank.__getitem__)


@dataclass(frozen=True)
class Schedule:
    """Outcome of one run. Arrays are indexed by request (``start``, ``finish``) or by
    iteration ``tau`` = 0..T (``memory``, ``active``, ``prefill``; entry 0 is always 0).

    ``start``: admission boundary; ``finish``: ``start + o`` (iteration of the last token);
    ``memory``: KV tokens held in iteration tau; ``active``: requests producing a token in
    tau; ``prefill``: prompt tokens of requests whose first iteration is tau.
    """

    start: np.ndarray
    finish: np.ndarray
    arrival: np.ndarray
    memory: np.ndarray
    active: np.ndarray
    prefill: np.ndarray

    @property
    def latency(self) -> np.ndarray:
        """End-to-end latency per request, in iterations (finish - arrival)."""
        return self.finish - self.arrival

    @property
    def total_latency(self) -> int:
        """Total end-to-end latency (TEL), in iterations: the paper's objective."""
        return int(self.latency.sum())


@dataclass(frozen=True)
class IterationTime:
    """Linear batch-time model, Vidur-style: seconds(tau) = base + per_token * (prefill +
    decode tokens in tau) + per_kv * (KV tokens held in tau).

    Defaults are a roofline estimate for Llama-2-7B fp16 on one A100-80GB (1.5 TB/s HBM,
    ~200 dense TFLOP/s reachable): base 9 ms (reading 13.5 GB of weights), 0.07 ms per
    processed token (2 x 6.7 GFLOP), 0.33 us per resident KV token (0.5 MB read per token).
    """

    base_s: float = 9e-3
    per_token_s: float = 7e-5
    per_kv_token_s: float = 3.3e-7

    def latency_s(self, schedule: Schedule) -> np.ndarray:
        """Per-request end-to-end latency in seconds (idle iterations cost ``base_s``)."""
        step = (
            self.base_s
            + self.per_token_s * (schedule.prefill + schedule.active)
            + self.per_kv_token_s * schedule.memory
        )
        step[0] = 0.0
        clock = np.cumsum(step)
        return clock[schedule.finish] - clock[schedule.arrival]


def validate_lengths(s: np.ndarray, o: np.ndarray, memory_limit: int) -> None:
    """Raise ValueError unless s >= 0 and o >= 1 are equal-length integer vectors and every
    request fits alone (s_i + o_i <= M)."""
    if s.shape != o.shape or s.ndim != 1:
        raise ValueError(f"s and o must be equal-length vectors, got {s.shape} and {o.shape}")
    if s.size and (s.min() < 0 or o.min() < 1):
        raise ValueError("prompt lengths must be >= 0 and output lengths >= 1")
    too_big = np.flatnonzero(s + o > memory_limit)
    if too_big.size:
        raise ValueError(f"requests {too_big[:5].tolist()} need more than M={memory_limit} alone")


def execute(
    s: Sequence[int] | np.ndarray,
    o: Sequence[int] | np.ndarray,
    memory_limit: int,
    policy: AdmissionPolicy | Sequence[int],
    arrival: Sequence[int] | np.ndarray | None = None,
) -> Schedule:
    """Run an admission order in the §2 discrete-time model with a memory check at every step.

    ``s``, ``o``: prompt and output lengths in tokens, shape (n,); ``memory_limit``: M in KV
    tokens; ``policy``: an AdmissionPolicy or a plain order (sequence of request indices);
    ``arrival``: arrival boundary per request in iterations (default all 0, the offline
    case). Raises ValueError for malformed lengths or a request with s_i + o_i > M.
    """
    s = np.asarray(s, dtype=np.int64)
    o = np.asarray(o, dtype=np.int64)
    validate_lengths(s, o, memory_limit)
    n = s.size
    arrival = np.zeros(n, np.int64) if arrival is None else np.asarray(arrival, np.int64)
    if not isinstance(policy, AdmissionPolicy):
        policy = StaticOrder(list(policy))
    horizon = int((arrival.max() if n else 0) + o.sum() + 2)
    memory = np.zeros(horizon, np.int64)
    active = np.zeros(horizon, np.int64)
    prefill = np.zeros(horizon, np.int64)
    ramp = np.arange(1, int(o.max(initial=1)) + 1, dtype=np.int64)
    start = np.full(n, -1, np.int64)
    by_arrival = np.argsort(arrival, kind="stable").tolist()
    waiting: list[int] = []
    queue: list[int] = []
    head = arrived = admitted = 0
    last_call = t = 0
    while admitted < n:
        fresh = False
        while arrived < n and arrival[by_arrival[arrived]] <= t:
            waiting.append(by_arrival[arrived])
            arrived += 1
            fresh = True
        due = policy.refresh_every is not None and t - last_call >= policy.refresh_every
        if waiting and (fresh or due):
            queue, head, last_call = policy.queue(t, waiting), 0, t
        while head < len(queue):
            i = queue[head]
            window = slice(t + 1, t + 1 + int(o[i]))
            need = s[i] + ramp[: o[i]]
            if (memory[window] + need).max() > memory_limit:
                break
            memory[window] += need
            active[window] += 1
            prefill[t + 1] += s[i]
            start[i] = t
            waiting.remove(i)
            head += 1
            admitted += 1
        t = t + 1 if waiting or arrived == n else max(t + 1, int(arrival[by_arrival[arrived]]))
    finish = start + o
    end = int(finish.max(initial=0)) + 1
    return Schedule(start, finish, arrival, memory[:end], active[:end], prefill[:end])


@dataclass(frozen=True)
class AminResult:
    """A_min outcome: ``schedule`` of the final (completed) runs and the evictions, each
    ``(iteration, request)`` in the order they happened."""

    schedule: Schedule
    evictions: list[tuple[int, int]]


def execute_amin(
    s: Sequence[int] | np.ndarray,
    o_true: Sequence[int] | np.ndarray,
    lower: Sequence[int] | np.ndarray,
    upper: Sequence[int] | np.ndarray,
    memory_limit: int,
) -> AminResult:
    """A_min (Chen, Ye, Zhou 2025, as used in arXiv 2508.06133 §6): output lengths known only
    as intervals [l_i, u_i]; the estimate starts at l_i, admission is ascending estimate
    while the *estimated* future peak fits M, and the estimate of a running request rises to
    tokens produced + 1 once produced reaches it. When the real memory of the next iteration
    would exceed M, running requests are evicted in ascending (estimate, index) order until
    it fits; an evicted request loses its KV cache (progress restarts) and rejoins the queue
    keeping its raised estimate.

    All requests arrive at 0. Shapes (n,), tokens; returns AminResult (latency in iterations).
    Raises ValueError for malformed lengths or intervals that do not contain o_true.
    """
    s = np.asarray(s, np.int64)
    o_true = np.asarray(o_true, np.int64)
    est = np.asarray(lower, np.int64).copy()
    upper = np.asarray(upper, np.int64)
    validate_lengths(s, o_true, memory_limit)
    if np.any(est < 1) or np.any(est > o_true) or np.any(o_true > upper):
        raise ValueError("need 1 <= l_i <= o_i <= u_i for every request")
    n = s.size
    produced = np.zeros(n, np.int64)
    start = np.full(n, -1, np.int64)
    running: list[int] = []
    waiting = list(range(n))
    evictions: list[tuple[int, int]] = []
    memory, active, prefill = [0], [0], [0]
    t = 0
    while waiting or running:
        horizon = int(est[running + waiting].max() - produced[running].min(initial=0)) + 1
        ramp = np.arange(1, horizon + 1)
        profile = np.zeros(horizon, np.int64)
        for j in running:
            remaining = int(est[j] - produced[j])
            profile[:remaining] += s[j] + produced[j] + ramp[:remaining]
        admitted_now = 0
        for i in sorted(waiting, key=lambda r: (est[r], r)):
            trial = profile.copy()
            trial[: est[i]] += s[i] + ramp[: est[i]]
            if trial.max() > memory_limit:
                break
            profile, start[i] = trial, t
            running.append(i)
            waiting.remove(i)
            admitted_now += int(s[i])
        t += 1
        need = sum(int(s[j] + produced[j] + 1) for j in running)
        for j in sorted(running, key=lambda r: (est[r], r)):
            if need <= memory_limit:
                break
            need -= int(s[j] + produced[j] + 1)
            running.remove(j)
            produced[j] = 0
            waiting.append(j)
            evictions.append((t, j))
            if start[j] == t - 1:
                admitted_now -= int(s[j])
        produced[running] += 1
        memory.append(need)
        active.append(len(running))
        prefill.append(admitted_now)
        for j in list(running):
            if produced[j] == o_true[j]:
                running.remove(j)
                start[j] = t - o_true[j]
            elif produced[j] >= est[j]:
                est[j] = produced[j] + 1
    finish = start + o_true
    schedule = Schedule(
        start, finish, np.zeros(n, np.int64), np.array(memory), np.array(active), np.array(prefill)
    )
    return AminResult(schedule, evictions)
