"""What the scheduler must know of the prefill engines to predict their TTFT, built from the deployment's configuration.

Pass times: ``scheduling.cost_model`` (fitted on a running engine by ``laps
calibrate``) when set; otherwise the engine model the first prefill engine would
run as a simulated engine (:func:`engines.manager.sim_model`: ``sim.model`` on
``sim.gpu``, ``sim.calibration`` when set, its role's CUDA-graph flags, its
tensor-parallel size). For ``kind: sim`` engines that is the engines' own
latency; for real SGLang it is a prior until calibrated.
The chunk size and queue order come from the prefill roles' flags.
"""

from __future__ import annotations

from engines.manager import sim_model
from laps.config import Config
from policies.classifier import PrefillCostModel
from policies.ttft_model import EngineTraits, PassCost

SGLANG_CHUNKED_PREFILL_SIZE = 8192  # SGLang 0.5.23's default on GPUs with H200's memory (and the simulated engine's)


def pass_cost(config: Config) -> PassCost:
    """The :class:`~policies.ttft_model.PassCost` of ``config``'s prefill engines (module doc)."""
    fit = config.scheduling.cost_model
    if fit is not None:
        return PrefillCostModel(fit.alpha, fit.beta, fit.gamma_w, fit.gamma_r, fit.memory_floor_s)
    prefill = next(e for e in config.engines if config.pool(e) != "decode")  # a config always has one
    return sim_model(config, prefill).latency


def engine_traits(config: Config) -> EngineTraits:
    """Pass cost, the largest ``chunked-prefill-size`` and whether every prefill role runs ``shortest-prefill-first``."""
    roles = [config.roles[e.role] for e in config.engines if config.pool(e) != "decode"]
    chunks = [r.flags.get("chunked-prefill-size", SGLANG_CHUNKED_PREFILL_SIZE) for r in roles]
    chunk = max((int(c) for c in chunks if isinstance(c, int) and c > 0), default=SGLANG_CHUNKED_PREFILL_SIZE)
    short_first = bool(roles) and all(r.flags.get("schedule-policy") == "shortest-prefill-first" for r in roles)
    return EngineTraits(pass_cost(config), chunk, short_first)
