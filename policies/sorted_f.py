"""Sorted-F (Wang, Ye, Zhou, arXiv 2508.06133, §3 Algorithm 1): admit batches that minimise
F(X) = sum_{i in X} o_i / |X|^2, ties to the larger batch.

Phase 1 repeatedly picks, among the remaining requests, a memory-feasible batch X with the
smallest F and appends it to the order with its members in ascending o_i. Phase 2 admits
requests in that order whenever memory allows (``backlog_executor.execute``). A batch X
started together is feasible when, for every output step j, sum_{i in X, o_i >= j}(s_i + j)
<= M; the maximum is reached at some j = o_i, so with X sorted by descending o the test is
cumsum(s) + rank * o <= M.

Phase-1 solvers, all ``solver(s, o, M, candidates) -> chosen indices``:
``exact_dp`` (optimal, O(n^2 M), for n <= 100), ``local_swap`` (n <= 500) and
``quantile_greedy`` (n >= 1000). Every solver ends with ``drop_longest``, so each batch it
returns satisfies Lemma 3.2: mean output > max output / 2.

Lengths are integer token counts; M is in KV tokens. Nothing here reads a clock or draws
random numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Solver = Callable[[np.ndarray, np.ndarray, int, np.ndarray], np.ndarray]


def peak_memory(s: np.ndarray, o: np.ndarray) -> int:
    """Peak KV memory (tokens) of requests started together: max_j sum_{o_i>=j}(s_i + j).

    ``s``, ``o``: shape (k,) prompt and output lengths of the batch; 0 for an empty batch.
    """
    if s.size == 0:
        return 0
    desc = np.argsort(-o, kind="stable")
    rank = np.arange(1, s.size + 1)
    return int((np.cumsum(s[desc]) + rank * o[desc]).max())


def _better(sum_a: int, k_a: int, sum_b: int, k_b: int) -> bool:
    """F(A) < F(B), ties to the larger batch, compared exactly in integers."""
    lhs, rhs = sum_a * k_b * k_b, sum_b * k_a * k_a
    return lhs < rhs or (lhs == rhs and k_a > k_b)


def drop_longest(o: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """Lemma 3.2 step: remove the longest-output member while that strictly lowers F.

    Returns a batch with (2k - 1) * sum(o) >= k^2 * max(o), hence mean(o) > max(o) / 2.
    Removing a member never breaks memory feasibility.
    """
    batch = batch[np.argsort(o[batch], kind="stable")]
    total = int(o[batch].sum())
    while batch.size > 1:
        k, longest = batch.size, int(o[batch[-1]])
        if not _better(total - longest, k - 1, total, k):
            break
        batch, total = batch[:-1], total - longest
    return batch


def exact_dp(s: np.ndarray, o: np.ndarray, memory_limit: int, cand: np.ndarray) -> np.ndarray:
    """Exact Phase-1 solver (§4 dynamic programme, O(n^2 M)): argmin F over feasible subsets.

    Requests are scanned in descending o; state (count c, prompt sum m) keeps the least
    output sum. Adding request i as the current shortest is feasible iff
    m + s_i + (c + 1) o_i <= M, which is exactly the peak constraint at step j = o_i.
    Memory use is O(n^2 M / 8) bytes for the back-pointers.
    """
    order = cand[np.lexsort((cand, -o[cand]))]
    n = order.size
    cap = int(min(memory_limit, s[order].sum()))
    inf = np.iinfo(np.int64).max // 4
    dp = np.full((n + 1, cap + 1), inf, np.int64)
    dp[0, 0] = 0
    takes: list[np.ndarray] = []
    cols = np.arange(cap + 1)
    for idx, i in enumerate(order):
        si, oi = int(s[i]), int(o[i])
        width = cap + 1 - si
        limit = memory_limit - si - (np.arange(idx + 1) + 1) * oi
        offer = np.where(cols[None, :width] <= limit[:, None], dp[: idx + 1, :width] + oi, inf)
        target = dp[1 : idx + 2, si:]
        take = offer < target
        target[take] = offer[take]
        takes.append(np.packbits(take, axis=1))
    best_c, best_sum = 1, int(dp[1].min())
    for c in range(2, n + 1):
        total = int(dp[c].min())
        if total < inf and _better(total, c, best_sum, best_c):
            best_c, best_sum = c, total
    c, m = best_c, int(np.argmin(dp[best_c]))
    chosen = []
    for idx in range(n - 1, -1, -1):
        si = int(s[order[idx]])
        if c == 0:
            break
        if c - 1 <= idx and m >= si:
            row = np.unpackbits(takes[idx][c - 1], count=cap + 1 - si)
            if row[m - si]:
                chosen.append(order[idx])
                c, m = c - 1, m - si
    return drop_longest(o, np.array(chosen, np.int64))


def longest_fitting_prefix(s: np.ndarray, o: np.ndarray, memory_limit: int, pool: np.ndarray) -> int:
    """Largest p with pool[:p] feasible (peak is monotone in p); galloping then bisection."""
    def fits(p: int) -> bool:
        return peak_memory(s[pool[:p]], o[pool[:p]]) <= memory_limit

    lo, hi = 1, 2
    while hi <= pool.size and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, pool.size + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def quantile_greedy(
    s: np.ndarray, o: np.ndarray, memory_limit: int, cand: np.ndarray, quantiles: int = 8
) -> np.ndarray:
    """Quantile-greedy Phase-1 solver (§4 heuristic): for each output threshold at the
    1/q, 2/q, ..., 1 quantiles of the remaining o, take requests with o_i <= threshold in
    ascending footprint s_i + o_i, keep the longest prefix that fits M, cut it at its best
    F; return the best batch over thresholds.
    """
    out = o[cand]
    levels = np.unique(np.quantile(out, np.arange(1, quantiles + 1) / quantiles, method="higher"))
    best = cand[:1]
    best_sum = int(o[best].sum())
    for level in levels:
        pool = cand[out <= level]
        pool = pool[np.lexsort((o[pool], s[pool] + o[pool]))]
        p = longest_fitting_prefix(s, o, memory_limit, pool)
        sums = np.cumsum(o[pool[:p]])
        sizes = np.arange(1, p + 1)
        score = sums / sizes**2
        k = int(np.flatnonzero(score == score.min())[-1]) + 1
        if _better(int(sums[k - 1]), k, best_sum, best.size):
            best, best_sum = pool[:k], int(sums[k - 1])
    return drop_longest(o, best)


def local_swap(
    s: np.ndarray,
    o: np.ndarray,
    memory_limit: int,
    cand: np.ndarray,
    seed: np.ndarray | None = None,
    width: int = 24,
    max_rounds: int = 32,
) -> np.ndarray:
    """Local-swap Phase-1 solver (§4 local search): start from ``seed`` (default: the
    quantile-greedy batch) and apply the first improving move until none is left:
    add one outside request; swap a member for a shorter outside one; drop the member with
    the largest footprint and refill greedily. Outside requests tried: the ``width``
    shortest and the ``width`` smallest-footprint ones. ``seed`` must be feasible.
    """
    batch = quantile_greedy(s, o, memory_limit, cand) if seed is None else seed
    for _ in range(max_rounds):
        moved = _improve_once(s, o, memory_limit, cand, batch, width)
        if moved is None:
            break
        batch = drop_longest(o, moved)
    return drop_longest(o, batch)


def _improve_once(
    s: np.ndarray, o: np.ndarray, memory_limit: int, cand: np.ndarray, batch: np.ndarray, width: int
) -> np.ndarray | None:
    """One first-improvement step of ``local_swap``; None when no move lowers F."""
    outside = np.setdiff1d(cand, batch, assume_unique=True)
    if outside.size == 0:
        return None
    by_o = outside[np.argsort(o[outside], kind="stable")[:width]]
    by_foot = outside[np.argsort(s[outside] + o[outside], kind="stable")[:width]]
    tries = np.unique(np.concatenate([by_o, by_foot]))
    total, k = int(o[batch].sum()), batch.size

    def fits(x: np.ndarray) -> bool:
        return peak_memory(s[x], o[x]) <= memory_limit

    for c in tries[np.argsort(o[tries], kind="stable")]:
        grown = np.append(batch, c)
        if _better(total + int(o[c]), k + 1, total, k) and fits(grown):
            return grown
    for j in batch[np.argsort(-o[batch], kind="stable")[:4]]:
        for c in tries[o[tries] < o[j]]:
            swapped = np.append(batch[batch != j], c)
            if fits(swapped):
                return swapped
    heavy = batch[np.argmax(s[batch] + o[batch])]
    refill = batch[batch != heavy]
    for c in tries[np.argsort(s[tries] + o[tries], kind="stable")]:
        grown = np.append(refill, c)
        if fits(grown):
            refill = grown
    if _better(int(o[refill].sum()), refill.size, total, k):
        return refill
    return None


SOLVERS: dict[str, Solver] = {"dp": exact_dp, "swap": local_swap, "quantile": quantile_greedy}


def pick_solver(n: int) -> Solver:
    """The paper's size rule: exact DP for n <= 100, local swap for n <= 500, else quantile."""
    return exact_dp if n <= 100 else local_swap if n <= 500 else quantile_greedy


def sorted_f_batches(
    s: Sequence[int] | np.ndarray,
    o: Sequence[int] | np.ndarray,
    memory_limit: int,
    solver: Solver | str = "auto",
    cand: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Sorted-F Phase 1 (Algorithm 1): the batches in selection order, each in ascending o.

    ``s``, ``o``: (n,) token lengths; ``solver``: a Solver, a SOLVERS key or "auto"
    (``pick_solver``); ``cand``: the requests to order (default all). Raises ValueError if
    a request has s_i + o_i > M (it could never be admitted) or the solver name is unknown.
    """
    s = np.asarray(s, np.int64)
    o = np.asarray(o, np.int64)
    remaining = np.arange(s.size) if cand is None else np.asarray(cand, np.int64)
    if np.any(s[remaining] + o[remaining] > memory_limit):
        raise ValueError(f"a request needs more than M={memory_limit} KV tokens alone")
    if isinstance(solver, str):
        if solver != "auto" and solver not in SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose from {sorted(SOLVERS)} or 'auto'")
        solver = pick_solver(remaining.size) if solver == "auto" else SOLVERS[solver]
    batches = []
    while remaining.size:
        batch = solver(s, o, memory_limit, remaining)
        batches.append(batch[np.lexsort((batch, o[batch]))])
        remaining = np.setdiff1d(remaining, batch, assume_unique=True)
    return batches


def sorted_f_order(
    s: Sequence[int] | np.ndarray,
    o: Sequence[int] | np.ndarray,
    memory_limit: int,
    solver: Solver | str = "auto",
    cand: np.ndarray | None = None,
) -> list[int]:
    """Sorted-F admission order: the Phase-1 batches concatenated (see sorted_f_batches)."""
    return np.concatenate(sorted_f_batches(s, o, memory_limit, solver, cand)).tolist()


class SortedFOnline:
    """Sorted-F-Online (§5 receding horizon): re-run Phase 1 every ``refresh_every``
    iterations, or sooner when the backlog has grown by ``growth`` (x1.5) since the last
    plan, over a look-ahead window of the ``lookahead`` earliest-arrived waiting requests;
    the rest follow in ascending s_i + o_i. Between plans, new arrivals are queued after the
    planned ones in ascending s_i + o_i. An AdmissionPolicy for ``backlog_executor.execute``.
    """

    def __init__(
        self,
        s: Sequence[int] | np.ndarray,
        o: Sequence[int] | np.ndarray,
        memory_limit: int,
        solver: Solver | str = "quantile",
        refresh_every: int = 10,
        growth: float = 1.5,
        lookahead: int = 300,
    ) -> None:
        self.s = np.asarray(s, np.int64)
        self.o = np.asarray(o, np.int64)
        self.memory_limit = memory_limit
        self.solver = solver
        self.refresh_every = refresh_every
        self.growth = growth
        self.lookahead = lookahead
        self.plans = 0
        self._planned_at = -refresh_every
        self._planned_size = 0
        self._rank: dict[int, int] = {}

    def queue(self, t: int, waiting: Sequence[int]) -> list[int]:
        """Waiting requests (arrival order in) in admission order (see class doc)."""
        stale = t - self._planned_at >= self.refresh_every
        grown = len(waiting) >= self.growth * max(self._planned_size, 1)
        if stale or grown:
            window = np.asarray(waiting[: self.lookahead], np.int64)
            head = sorted_f_order(self.s, self.o, self.memory_limit, self.solver, window)
            self._rank = {rid: pos for pos, rid in enumerate(head)}
            self._planned_at, self._planned_size = t, len(waiting)
            self.plans += 1
        planned = sorted((r for r in waiting if r in self._rank), key=self._rank.__getitem__)
        rest = sorted((r for r in waiting if r not in self._rank), key=self._footprint)
        return planned + rest

    def _footprint(self, rid: int) -> tuple[int, int]:
        return int(self.s[rid] + self.o[rid]), rid
