"""Backlog baselines for Sorted-F (arXiv 2508.06133 §6): FCFS, MC-SF, and the LP-based
Sorted-LP and LP-Swap, with the LP relaxation of the time-indexed integer programme.

All return admission orders (lists of request indices) for ``backlog_executor.execute``.
Lengths are integer tokens, M is in KV tokens, time in iterations. Pure: no clock, no RNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csr_matrix

from policies.sorted_f import local_swap, longest_fitting_prefix, sorted_f_order


def fcfs_order(n: int) -> list[int]:
    """FCFS (§3.1): admit in arrival order, which is index order here."""
    return list(range(n))


def mc_sf_order(o: Sequence[int] | np.ndarray) -> list[int]:
    """MC-SF (Jaillet et al. 2025, §3.1 here): shortest output first, ties by index; the
    executor admits the head only when the future peak memory fits M."""
    o = np.asarray(o, np.int64)
    return np.lexsort((np.arange(o.size), o)).tolist()


@dataclass(frozen=True)
class LPRelaxation:
    """Solution of the time-indexed LP relaxation.

    ``bound``: optimal objective, sum over requests of fractional completion iteration;
    a lower bound on total latency (iterations) of every schedule when ``step == 1`` and
    the horizon covers sum(o). ``mean_completion``: (n,) sum_t x_{i,t} (t + o_i).
    """

    bound: float
    mean_completion: np.ndarray
    step: int


def lp_relaxation(
    s: Sequence[int] | np.ndarray,
    o: Sequence[int] | np.ndarray,
    memory_limit: int,
    step: int = 1,
    horizon: int | None = None,
) -> LPRelaxation:
    """LP relaxation of the time-indexed IP (§4, eq. for x_{i,t}), solved with HiGHS.

    Variables x_{i,k} in [0, 1]: request i starts at t_k = k * step, with t_k + o_i <=
    horizon (default sum(o), which contains every schedule without an idle iteration).
    Rows: sum_k x_{i,k} = 1; for every window r of ``step`` iterations, the mean KV memory
    of the requests running in it, sum_{(i,k)} x_{i,k} * (1/step) * sum over their output
    steps j in the window of (s_i + j), is <= M. Objective: sum x_{i,k} (t_k + o_i). With
    step = 1 the windows are single iterations, the rows are the IP's memory constraints
    and the optimum is a lower bound; a coarser step (starts on window boundaries, mean
    memory per window) is a smaller heuristic LP for Sorted-LP at large n.
    Raises ValueError on a horizon shorter than some o_i, RuntimeError if HiGHS fails.
    """
    s = np.asarray(s, np.int64)
    o = np.asarray(o, np.int64)
    horizon = int(o.sum()) if horizon is None else horizon
    if horizon < o.max():
        raise ValueError(f"horizon {horizon} is shorter than the longest output {o.max()}")
    rows, cols, vals, owner, finish = [], [], [], [], []
    var = 0
    for i in range(s.size):
        slots = np.arange((horizon - int(o[i])) // step + 1)
        span = np.arange((int(o[i]) - 1) // step + 1)
        rows.append((slots[:, None] + span[None, :]).ravel())
        cols.append(np.repeat(var + slots, span.size))
        first = span * step + 1
        last = np.minimum(first + step - 1, o[i])
        area = (last - first + 1) * (2 * s[i] + first + last) / 2
        vals.append(np.tile(area / step, slots.size))
        finish.append(slots * step + o[i])
        owner.append(np.full(slots.size, i))
        var += slots.size
    cost = np.concatenate(finish).astype(float)
    owner = np.concatenate(owner)
    rows = np.concatenate(rows)
    a_ub = csr_matrix((np.concatenate(vals), (rows, np.concatenate(cols))), shape=(rows.max() + 1, var))
    a_eq = csr_matrix((np.ones(var), (owner, np.arange(var))), shape=(s.size, var))
    res = linprog(
        cost,
        A_ub=a_ub,
        b_ub=np.full(a_ub.shape[0], memory_limit),
        A_eq=a_eq,
        b_eq=np.ones(s.size),
        bounds=(0, 1),
        method="highs",
    )
    if res.status != 0:
        raise RuntimeError(f"HiGHS did not solve the LP: {res.message}")
    mean_completion = np.bincount(owner, weights=res.x * cost, minlength=s.size)
    return LPRelaxation(float(res.fun), mean_completion, step)


def sorted_lp_order(o: Sequence[int] | np.ndarray, lp: LPRelaxation) -> list[int]:
    """Sorted-LP (§4): admit in ascending LP mean completion time, ties by shorter output."""
    o = np.asarray(o, np.int64)
    return np.lexsort((np.arange(o.size), o, lp.mean_completion)).tolist()


def lp_swap_order(
    s: Sequence[int] | np.ndarray,
    o: Sequence[int] | np.ndarray,
    memory_limit: int,
    lp: LPRelaxation,
) -> list[int]:
    """LP-Swap (§4): Sorted-F whose local-swap search starts each round from the LP seed,
    the longest prefix of the remaining requests in Sorted-LP order that fits M."""
    s = np.asarray(s, np.int64)
    o = np.asarray(o, np.int64)
    rank = np.empty(o.size, np.int64)
    rank[sorted_lp_order(o, lp)] = np.arange(o.size)

    def seeded(s: np.ndarray, o: np.ndarray, memory_limit: int, cand: np.ndarray) -> np.ndarray:
        pool = cand[np.argsort(rank[cand], kind="stable")]
        seed = pool[: longest_fitting_prefix(s, o, memory_limit, pool)]
        return local_swap(s, o, memory_limit, cand, seed=seed)

    return sorted_f_order(s, o, memory_limit, seeded)
