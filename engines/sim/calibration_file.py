"""A calibration file: the engine model's two efficiencies measured on real hardware.

``bench/gpu_check.py`` times a Qwen2.5-7B-shaped transformer on a GPU, fits
:class:`~engines.sim.latency.LatencyModel`'s ``compute_efficiency`` and
``memory_efficiency`` to its own passes (:func:`engines.sim.calibration.fit_latency`)
and writes them here with :func:`calibration_document`; a simulated engine loads
them instead of the shipped defaults (fitted to the published anchors) with
``--sim-calibration PATH``, which the engine manager passes from the deployment
file's ``sim.calibration``. The file is JSON::

    {"format": "laps-sim-calibration/1", "gpu": "h200",
     "compute_efficiency": 0.8, "memory_efficiency": 0.9, ...}

``gpu`` names the :data:`~engines.sim.latency.GPUS` preset whose measured GEMM
and copy rates the efficiencies scale, so a file only applies to that GPU; any
other keys are the check's report and are not read. The efficiencies carry over
to the other model presets, as the shipped ones do (they are fractions of the
hardware's rates, not per-model constants). Standard library only: simulated
engines import this at start-up, and the GPU machine has none of the gateway's
packages.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.sim.latency import GPUS, LatencyModel

CALIBRATION_FORMAT = "laps-sim-calibration/1"
CALIBRATED_FIELDS = ("compute_efficiency", "memory_efficiency")
"""The :class:`LatencyModel` fields a calibration file sets (and the fit fits)."""


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message starts with its path."""


@dataclass(frozen=True, slots=True)
class Calibration:
    """Efficiencies (fractions of ``gpu``'s measured GEMM and copy rates) loaded from ``path``."""

    path: str
    gpu: str
    compute_efficiency: float
    memory_efficiency: float

    def apply(self, latency: LatencyModel) -> LatencyModel:
        """``latency`` with this file's efficiencies.

        Raises:
            CalibrationError: ``latency`` models another GPU than the one the file was fitted against.
        """
        if latency.gpu.name != self.gpu:
            raise CalibrationError(f"{self.path}: fitted against the {self.gpu} preset, but the simulated GPU is "
                                   f"{latency.gpu.name}")
        return dataclasses.replace(latency, compute_efficiency=self.compute_efficiency,
                                   memory_efficiency=self.memory_efficiency)


def calibration_document(gpu: str, fitted: LatencyModel, report: dict[str, Any]) -> dict[str, Any]:
    """The JSON object of a calibration file: ``fitted``'s efficiencies against ``gpu``, then ``report``'s keys.

    Raises:
        ValueError: ``gpu`` is not a :data:`GPUS` preset, or ``report`` reuses a key of the file's own.
    """
    if gpu not in GPUS:
        raise ValueError(f"unknown gpu preset {gpu!r}; choose from {sorted(GPUS)}")
    document: dict[str, Any] = {"format": CALIBRATION_FORMAT, "gpu": gpu}
    document.update({name: getattr(fitted, name) for name in CALIBRATED_FIELDS})
    clash = sorted(set(document) & set(report))
    if clash:
        raise ValueError(f"report keys {clash} are the calibration's own")
    return document | report


def load_calibration(path: str | Path) -> Calibration:
    """Read and check a calibration file.

    Raises:
        CalibrationError: the file cannot be read, is not JSON, has another ``format``, names an
            unknown ``gpu`` preset, or an efficiency that is not a positive finite number.
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise CalibrationError(f"{path}: cannot read calibration: {err.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CalibrationError(f"{path}: not a JSON calibration file: {err}") from None
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CalibrationError(f"{path}: format must be {CALIBRATION_FORMAT!r}, got {found!r}")
    gpu = data.get("gpu")
    if gpu not in GPUS:
        raise CalibrationError(f"{path}: gpu must be one of {sorted(GPUS)}, got {gpu!r}")
    values = {}
    for name in CALIBRATED_FIELDS:
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise CalibrationError(f"{path}: {name} must be a positive number, got {value!r}")
        values[name] = float(value)
    return Calibration(str(path), gpu, **values)
