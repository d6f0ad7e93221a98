"""`laps`'s argument checks: bad flags are one line and exit status 2 before anything runs."""

from __future__ import annotations

import pytest

from laps.cli import main as laps_main

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
