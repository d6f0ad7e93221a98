"""A lower bound on the TTFT SLO violations that any scheduler could have on one run's arrivals (engine model).

Used by ``bench/dominance.py`` to say, with numbers, whether a target it misses could be met at all. The
bound relaxes everything but the prefill compute that each request's first token needs:

* **Work.** Request j needs its uncached prompt tokens prefilled between its arrival r_j and its deadline
  d_j = r_j + ``slo_ttft_s`` (its first token is sampled at the end of its prefill). Its work p_j is the
  compute part alone of the engine model's pass time (:meth:`engines.sim.latency.LatencyModel.prefill_compute_s`:
  c_tok·L + c_seq + c_pair·(L·H + L(L+1)/2) for L new tokens on H cached ones). A pass takes at least
  the compute of every sequence in it (the linear layers run at least N tokens, attention the same
  (query, key) pairs however the prompt is chunked), so no batching, chunking or CUDA graph makes a
  request's prefill cheaper than p_j; the weight reads, the fixed per-pass costs and every decode step are
  left out (a scheduler may defer decoding: only TTFT is judged).
* **Cache.** H is what an unbounded, perfect prefix cache could hold when j arrives
  (:class:`IdealPrefixCache`): the longest prefix j shares with any earlier prompt, rounded *up* to the
  next 16-token block, and for a follow-up turn everything before its new user message (the conversation's
  earlier prompt and reply), whichever is more; never the whole prompt (one token is always computed).
* **One engine per request.** A prefill runs on one engine (its chunks one after another), so a request whose
  work alone exceeds ``slo_ttft_s`` misses whatever the schedule (on ``shared-docs`` a 30k-token document's first
  question); those are counted outright and left out of the windows below.
* **Engines.** For any window [a, b], the requests with a ≤ r_j and d_j ≤ b that meet their deadline had
  their whole prefill inside it, on ``engines`` engines: at most ``engines``·(b − a) seconds of compute.
  When their work exceeds that, at least k(a, b) of them miss, k the fewest that can be dropped to fit
  (dropping the largest first is fewest). Disjoint windows hold disjoint requests and disjoint engine
  time, so the k of disjoint windows add up; :func:`violation_floor` takes the best sum over windows on a
  grid (dynamic programming). The windows still let one request's work spread over several engines at once, which
  is where the bound is loosest.

The floor is a valid bound for the run's arrivals, not a schedule: it ignores decode, KV memory, request
slots and the engines' passes, so a real scheduler may be far above it. For a multi-turn workload the
arrival of a follow-up turn depends on when the answer before it ended, so the floor is that of the run it
was taken from. Only the fixed objective is bounded (a length-aware deadline depends on each schedule's
own cache hits).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BLOCK_TOKENS = 16


class IdealPrefixCache:
    """The prefix an unbounded, perfect prefix cache could hold for each arriving prompt (an upper bound on H).

    Prompts are kept as chains of 16-token block hashes (memory: one hash per full block of every prompt
    seen); a prompt's hit is its longest run of leading blocks seen before, plus one block (the partial
    match inside the first unseen block is not checked, so it is counted in full).
    """

    def __init__(self) -> None:
        self._blocks: set[int] = set()

    def arrive(self, prompt_ids: Sequence[int], unshared_tail_tokens: int | None = None) -> int:
        """The hit bound of ``prompt_ids`` (tokens), then remember them.

        ``unshared_tail_tokens``: for a follow-up turn, how many of the prompt's last tokens no earlier
        sequence can hold (its new user message and what follows it); everything before them counts as cached.
        """
        n = len(prompt_ids)
        matched, chain, seen = 0, 0, True
        for start in range(0, n - n % BLOCK_TOKENS, BLOCK_TOKENS):
            chain = hash((chain, tuple(prompt_ids[start:start + BLOCK_TOKENS])))
            if seen and chain in self._blocks:
                matched = start + BLOCK_TOKENS
            else:
                seen = False
                self._blocks.add(chain)
        hit = matched + BLOCK_TOKENS
        if unshared_tail_tokens is not None:
            hit = max(hit, n - max(1, unshared_tail_tokens))
        return max(0, min(n - 1, hit))


def violation_floor(arrival_s: Sequence[float], work_s: Sequence[float], slo_ttft_s: float, engines: int,
                    step_s: float = 0.05, max_window_s: float = 4.0) -> int:
    """The fewest requests that must miss ``slo_ttft_s`` (module doc): those whose own work exceeds it, plus a sum of
    k over disjoint windows for the rest.

    Windows start and end on a grid of ``step_s`` from the first arrival and last at most ``max_window_s``.
    ``arrival_s`` and ``work_s`` are per request (seconds); ``engines`` the prefill engines. O(G·W·n log n)
    for G grid points, W = ``max_window_s``/``step_s`` and n requests.

    Raises:
        ValueError: mismatched lengths, ``engines`` < 1, or a non-positive ``slo_ttft_s``, ``step_s`` or ``max_window_s``.
    """
    if len(arrival_s) != len(work_s):
        raise ValueError(f"{len(arrival_s)} arrivals but {len(work_s)} works")
    if engines < 1 or min(slo_ttft_s, step_s, max_window_s) <= 0:
        raise ValueError("engines must be >= 1 and slo_ttft_s, step_s, max_window_s > 0")
    if not arrival_s:
        return 0
    order = np.argsort(arrival_s, kind="stable")
    r = np.asarray(arrival_s, dtype=float)[order]
    p = np.asarray(work_s, dtype=float)[order]
    alone_late = p > slo_ttft_s
    forced = int(alone_late.sum())
    r, p = r[~alone_late], p[~alone_late]
    if not len(r):
        return forced
    t0 = r[0]
    points = int(np.ceil((r[-1] + slo_ttft_s - t0) / step_s)) + 1
    grid = t0 + step_s * np.arange(points + 1)
    span = max(1, int(round(max_window_s / step_s)))
    first = np.searchsorted(r, grid, side="left")  # first request arriving at or after grid[g]
    due = np.searchsorted(r, grid - slo_ttft_s, side="right")  # requests whose deadline is at or before grid[g]
    total = np.concatenate(([0.0], np.cumsum(p)))
    best = np.zeros(points + 1, dtype=int)
    for end in range(1, points + 1):
        best[end] = best[end - 1]
        last = due[end]
        for start in range(max(0, end - span), end):
            lo = first[start]
            if lo >= last:
                continue
            excess = total[last] - total[lo] - engines * (grid[end] - grid[start])
            if excess <= 1e-12:
                continue
            dropped = np.cumsum(np.sort(p[lo:last])[::-1])
            k = int(np.searchsorted(dropped, excess - 1e-12, side="left")) + 1
            best[end] = max(best[end], best[start] + k)
    return forced + int(best[-1])


if __name__ == "__main__":
    raise SystemExit("violation_floor.py is a module of bench/dominance.py (each row's violation_floor): run that, "
                     "e.g. python bench/dominance.py --quick --out runs/dominance/quick.json")
