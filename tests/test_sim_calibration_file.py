"""Calibration files (engines/sim/calibration_file.py): loading, refusals, and ``sim.calibration`` reaching every engine model
(a bad one refused before anything starts: tests/test_engine_kinds.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from engines.manager import engine_command, sim_model
from engines.sim.args import parse_server_args, resolve_args
from engines.sim.calibration_file import (
    CALIBRATION_FORMAT,
    CalibrationError,
    calibration_document,
    load_calibration,
)
from engines.sim.latency import make_latency_model
from laps.config import DEFAULT_CONFIG_PATH, parse_config
from laps.tokenizer import load_tokenizer
from loadgen.virtual import engine_cores

PASS = [(2048, 0)]


def write(path: Path, **fields) -> Path:
    document = {"format": CALIBRATION_FORMAT, "gpu": "h200", "compute_efficiency": 0.5, "memory_efficiency": 0.4}
    path.write_text(json.dumps({**document, **fields}))
    return path


def config_with_calibration(path: Path | None):
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["sim"] = {**data.get("sim", {}), "calibration": None if path is None else str(path)}
    return parse_config(data)


def test_a_calibration_file_sets_the_two_efficiencies_and_changes_the_pass_time(tmp_path):
    path = write(tmp_path / "c.json", measured={"device": "NVIDIA H200"})  # report keys are not read
    assert load_calibration(path) == load_calibration(str(path))
    shipped = resolve_args(parse_server_args([])).latency
    calibrated = resolve_args(parse_server_args(["--sim-calibration", str(path)])).latency
    assert calibrated == dataclasses.replace(shipped, compute_efficiency=0.5, memory_efficiency=0.4)
    # 2048 tokens are compute-bound: the pass takes about 0.766 / 0.5 as long.
    assert calibrated.predict(PASS) > 1.4 * shipped.predict(PASS)
    assert calibrated.predict([(16, 0)]) > shipped.predict([(16, 0)])  # memory-bound: 0.733 / 0.4


def test_calibration_document_writes_what_load_calibration_reads(tmp_path):
    fitted = dataclasses.replace(make_latency_model(), compute_efficiency=0.9, memory_efficiency=0.8)
    document = calibration_document("h200", fitted, {"anchors": []})
    assert document == {"format": CALIBRATION_FORMAT, "gpu": "h200", "compute_efficiency": 0.9,
                        "memory_efficiency": 0.8, "anchors": []}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(document))
    assert load_calibration(path).apply(make_latency_model()) == fitted
    with pytest.raises(ValueError, match=r"report keys \['gpu'\] are the calibration's own"):
        calibration_document("h200", fitted, {"gpu": "x"})
    with pytest.raises(ValueError, match="unknown gpu preset 'v100'"):
        calibration_document("v100", fitted, {})


@pytest.mark.parametrize(("text", "message"), [
    (None, "cannot read calibration: No such file or directory"),
    ("{", "not a JSON calibration file: Expecting property name"),
    ("[1]", "format must be 'laps-sim-calibration/1', got 'list'"),
    ('{"format": "other/2"}', "format must be 'laps-sim-calibration/1', got 'other/2'"),
    ('{"format": "laps-sim-calibration/1", "gpu": "v100"}', "gpu must be one of ['a100', 'h100', 'h200'], got 'v100'"),
    ('{"format": "laps-sim-calibration/1", "gpu": "h200", "memory_efficiency": 1}',
     "compute_efficiency must be a positive number, got None"),
    ('{"format": "laps-sim-calibration/1", "gpu": "h200", "compute_efficiency": 0, "memory_efficiency": 1}',
     "compute_efficiency must be a positive number, got 0"),
    ('{"format": "laps-sim-calibration/1", "gpu": "h200", "compute_efficiency": 1, "memory_efficiency": NaN}',
     "memory_efficiency must be a positive number, got nan"),
    ('{"format": "laps-sim-calibration/1", "gpu": "h200", "compute_efficiency": true, "memory_efficiency": 1}',
     "compute_efficiency must be a positive number, got True"),
])
def test_an_unusable_calibration_file_is_refused_naming_the_file(tmp_path, text, message):
    path = tmp_path / "c.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(CalibrationError) as info:
        load_calibration(path)
    assert str(info.value).startswith(f"{path}: {message}")


def test_a_calibration_applies_only_to_the_gpu_it_was_fitted_against(tmp_path):
    path = write(tmp_path / "c.json")
    with pytest.raises(CalibrationError, match=r"c.json: fitted against the h200 preset, but the simulated GPU is h100"):
        resolve_args(parse_server_args(["--sim-gpu", "h100", "--sim-calibration", str(path)]))


def test_sim_calibration_reaches_engine_processes_and_the_virtual_time_simulator(tmp_path):
    path = write(tmp_path / "c.json")
    config = config_with_calibration(path)
    engine = next(e for e in config.engines if e.kind == "sim")
    command = engine_command(config, engine, 30001)
    assert command[-6:] == ["--sim-model", "qwen2.5-7b", "--sim-gpu", "h200", "--sim-calibration", str(path)]
    assert sim_model(config, engine).latency.compute_efficiency == 0.5
    cores = engine_cores(config, load_tokenizer())  # laps simulate
    assert {core.latency.memory_efficiency for core in cores.values()} == {0.4}
    plain = config_with_calibration(None)
    assert "--sim-calibration" not in engine_command(plain, engine, 30001)
    assert sim_model(plain, engine).latency.compute_efficiency == make_latency_model().compute_efficiency
