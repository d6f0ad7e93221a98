"""bench/servegen_lengths.py: rows drawn inside the pmf's bins, by their weights, seeded; a clear error otherwise."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from loadgen.trace_files import read_lengths

BENCH = Path(__file__).resolve().parent.parent / "bench" / "servegen_lengths.py"
_spec = importlib.util.spec_from_file_location("servegen_lengths", BENCH)
servegen_lengths = sys.modules["servegen_lengths"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(servegen_lengths)

PMF = """workload,field,bin_lo_incl,bin_hi_excl,prob
chat,input_tokens,0,16,0.0
chat,input_tokens,64,128,0.75
chat,input_tokens,1024,2048,0.25
chat,output_tokens,1,2,1.0
vision,input_text_tokens,8,16,1.0
vision,output_tokens,16,32,1.0
"""


def test_rows_fall_in_the_bins_with_their_weights_and_repeat_with_the_seed(tmp_path):
    pmf = tmp_path / "pmf.csv"
    pmf.write_text(PMF)
    out = tmp_path / "chat.csv"
    assert servegen_lengths.main(["--pmf", str(pmf), "--workload", "chat", "--rows", "2000", "--out", str(out)]) == 0
    rows = read_lengths(out)
    assert len(rows) == 2000 and {o for _, o in rows} == {1}
    assert all(64 <= n < 128 or 1024 <= n < 2048 for n, _ in rows)
    assert 0.70 < sum(n < 128 for n, _ in rows) / len(rows) < 0.80  # 0.75 by weight; binomial sd ~0.01
    again = tmp_path / "again.csv"
    servegen_lengths.main(["--pmf", str(pmf), "--workload", "chat", "--rows", "2000", "--out", str(again)])
    assert again.read_bytes() == out.read_bytes()
    vision = servegen_lengths.read_pmf(pmf, "vision")
    assert vision == ([(8, 16, 1.0)], [(16, 32, 1.0)])  # text tokens stand for the input where that is all there is


def test_a_draw_stays_below_the_bins_upper_bound():
    rng = random.Random(0)
    assert {servegen_lengths.draw([(0, 2, 1.0)], rng) for _ in range(200)} == {1}


@pytest.mark.parametrize(("text", "says"), [
    (PMF, "workload 'audio' has no input bins with probability (workloads: chat, vision)"),
    ("workload,field,bin_lo_incl,prob\n", "line 1: no column bin_hi_excl"),
    ("workload,field,bin_lo_incl,bin_hi_excl,prob\naudio,input_tokens,64,32,1\n", "line 2: bin [64, 32) with prob 1.0 is not a bin"),
    ("workload,field,bin_lo_incl,bin_hi_excl,prob\naudio,input_tokens,x,32,1\n", "line 2: a bin needs integer bounds"),
    ("workload,field,bin_lo_incl,bin_hi_excl,prob\naudio,output_tokens,4\n", "line 2: a bin needs integer bounds"),
    ("workload,field,bin_lo_incl,bin_hi_excl,prob\nchat,input_tokens,1,32,1\naudio,output_tokens,1,2,inf\n",
     "line 3: bin [1, 2) with prob inf is not a bin"),
])
def test_a_bad_pmf_or_workload_is_refused_with_what_is_wrong(tmp_path, capsys, text, says):
    pmf = tmp_path / "pmf.csv"
    pmf.write_text(text)
    with pytest.raises(SystemExit) as info:
        servegen_lengths.main(["--pmf", str(pmf), "--workload", "audio", "--out", str(tmp_path / "o.csv")])
    assert info.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "o.csv").exists()


def test_a_missing_pmf_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        servegen_lengths.main(["--pmf", str(tmp_path / "no.csv"), "--workload", "chat", "--out", str(tmp_path / "o.csv")])
    assert f"--pmf {tmp_path / 'no.csv'}: No such file or directory" in capsys.readouterr().err


def test_an_out_that_cannot_be_written_is_refused(tmp_path, capsys):
    pmf = tmp_path / "pmf.csv"
    pmf.write_text(PMF)
    with pytest.raises(SystemExit) as info:
        servegen_lengths.main(["--pmf", str(pmf), "--workload", "chat", "--out", str(tmp_path)])
    assert info.value.code == 2 and f"--out {tmp_path}: Is a directory" in capsys.readouterr().err
