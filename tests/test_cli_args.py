"""`laps`'s argument checks: bad flags are one line and exit status 2 before anything runs."""

from __future__ import annotations

import importlib.metadata

import pytest

import laps.demo
from laps.cli import build_parser
from laps.cli import main as laps_main
from loadgen.cli import http_url

# Each subcommand with a --seed, with the flags it requires.
SEEDED = {
    "loadgen": ["loadgen", "--url", "http://127.0.0.1:9"],
    "simulate": ["simulate", "--rate", "1"],
    "calibrate": ["calibrate", "--url", "http://127.0.0.1:9", "--out", "cost.yaml"],
    "demo": ["demo"],
}


@pytest.mark.parametrize("command", SEEDED)
@pytest.mark.parametrize("seed", [str(2**64), "-1", "1e3"])
def test_a_seed_outside_64_unsigned_bits_is_refused_before_the_run(command, seed, capsys):
    """The report's JSON writer takes at most 2**64 - 1; 2**64 was refused only after the whole run (TypeError)."""
    with pytest.raises(SystemExit) as info:
        laps_main([*SEEDED[command], "--seed", seed])
    said = "not an integer: '1e3'" if seed == "1e3" else f"must be in [0, {2**64 - 1}], got {seed}"
    assert (info.value.code, capsys.readouterr().err.splitlines()[-1]) == (2, f"laps {command}: error: argument --seed: {said}")


CALIBRATE = ["calibrate", "--url", "http://127.0.0.1:9"]  # nothing listens there: a run that measures fails (exit 1)


@pytest.mark.parametrize(("flags", "said"), [
    (["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["--repeats", "-1"], "argument --repeats: must be >= 1, got -1"),
    (["--new-tokens", "16", "-5"], "argument --new-tokens: must be >= 1, got -5"),
    (["--new-tokens", "0"], "argument --new-tokens: must be >= 1, got 0"),
    (["--cached-tokens", "-100"], "argument --cached-tokens: must be >= 0, got -100"),
    (["--url", "notaurl"], "argument --url: not an http:// or https:// URL with a host: 'notaurl'"),
    (["--out", "runs/"], "argument --out: 'runs/' names a folder, not a file"),
])
def test_calibrate_refuses_bad_flags(flags, said, capsys):
    """Were a StatisticsError (no repeats), a negative count measured, or a ValueError traceback (the URL)."""
    with pytest.raises(SystemExit) as info:
        laps_main([*CALIBRATE, "--out", "cost.yaml", *flags])
    assert (info.value.code, capsys.readouterr().err.splitlines()[-1]) == (2, f"laps calibrate: error: {said}")


@pytest.mark.parametrize(("grid", "points"), [
    (["--new-tokens", "16", "--cached-tokens", "0"], "1 × 1 = 1"),
    (["--new-tokens", "16", "32", "64", "--cached-tokens", "0", "0"], "3 × 1 = 3"),  # the same point twice is one
    (["--new-tokens", "16", "32", "64", "128", "256", "--cached-tokens", "0"], "5 × 1 = 5"),
])
def test_calibrate_refuses_a_grid_too_small_to_fit_before_measuring(grid, points, tmp_path, capsys):
    """policies.cost_fit's fit has 6 parameters; a smaller grid was measured, then failed the fit with a traceback."""
    assert laps_main([*CALIBRATE, "--out", str(tmp_path / "cost.yaml"), *grid]) == 2
    assert capsys.readouterr().err == (f"laps calibrate: --new-tokens × --cached-tokens: {points} distinct (L, H) points; "
                                       "fitting the cost model needs at least 6\n")


def test_calibrate_refuses_an_out_it_cannot_write_before_measuring(tmp_path, capsys):
    """As laps loadgen's --out (loadgen.outputs.check_output_path); a folder was found only after measuring."""
    (tmp_path / "a-file").write_text("")
    for out, says in ((tmp_path, "a directory, not a file name"),
                      (tmp_path / "a-file" / "cost.yaml", f"cannot make its folder ({tmp_path / 'a-file'} is not a folder)")):
        assert laps_main([*CALIBRATE, "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"laps calibrate: --out {out}: {says}\n"


@pytest.mark.parametrize("url", ["notaurl", "127.0.0.1:8000", "ftp://127.0.0.1", "http://", "http://127.0.0.1:0",
                                 "http://127.0.0.1:65536", "http://127.0.0.1:port"])
def test_loadgen_refuses_a_url_that_is_not_http_at_once(url, capsys):
    """Was found after the workload was loaded, as a failed GET of its /v1/models (exit status 1)."""
    with pytest.raises(SystemExit) as info:
        laps_main(["loadgen", "--url", url])
    assert (info.value.code, capsys.readouterr().err.splitlines()[-1]) == (
        2, f"laps loadgen: error: argument --url: not an http:// or https:// URL with a host: {url!r}")


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://gateway.example/prefix", "http://[::1]:30000/"])
def test_http_urls_are_taken_as_given(url):
    assert http_url(url) == url


def test_log_level_is_taken_before_and_after_the_subcommand():
    """After it was "unrecognized arguments"; given on both sides, the later one counts."""
    for argv, level in ((["serve"], "info"),
                        (["serve", "--log-level", "debug"], "debug"),
                        (["--log-level", "warning", "serve"], "warning"),
                        (["--log-level", "warning", "serve", "--log-level", "error"], "error"),
                        (["simulate", "--log-level", "debug", "--rate", "1"], "debug"),
                        (["calibrate", "--url", "http://127.0.0.1:9", "--out", "c.yaml", "--log-level", "error"], "error"),
                        (["demo", "--log-level", "warning"], "warning"),
                        (["loadgen", "--url", "http://127.0.0.1:9", "--log-level", "debug"], "debug")):
        assert build_parser().parse_args(argv).log_level == level, argv


@pytest.mark.parametrize("command", ["serve", "loadgen", "simulate", "calibrate", "demo"])
def test_every_subcommands_help_lists_log_level(command, capsys):
    with pytest.raises(SystemExit) as info:
        laps_main([command, "--help"])
    assert info.value.code == 0 and "--log-level {debug,info,warning,error}" in capsys.readouterr().out


def test_version_is_the_installed_distributions(monkeypatch, capsys):
    with pytest.raises(SystemExit) as info:
        laps_main(["--version"])
    assert (info.value.code, capsys.readouterr().out) == (0, f"laps {importlib.metadata.version('laps')}\n")

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)  # a checkout run without pip install -e
    with pytest.raises(SystemExit) as info:
        laps_main(["--version"])
    assert (info.value.code, capsys.readouterr().out) == (0, "laps (not installed)\n")


def test_demo_refuses_an_out_it_cannot_write_before_starting_anything(tmp_path, monkeypatch, capsys):
    """As laps loadgen's --out; the gateway and both engines were started first, then the load generator refused it."""

    def serving(config_path):
        raise AssertionError(f"the gateway was started with {config_path}")

    monkeypatch.setattr(laps.demo, "serving", serving)
    assert laps_main(["demo", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"laps demo: --out {tmp_path}: a directory, not a file name\n"
    (tmp_path / "r.png").mkdir()  # where the plot of r.json goes
    assert laps_main(["demo", "--out", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err == f"laps demo: --out's plot {tmp_path / 'r.png'}: a directory, not a file name\n"
    with pytest.raises(SystemExit) as info:
        laps_main(["demo", "--out", "runs/"])
    assert (info.value.code, capsys.readouterr().err.splitlines()[-1]) == (2, "laps demo: error: argument --out: 'runs/' names a folder, not a file")
