"""laps/doc_help.py: the bench scripts' docstring markup shown as plain text in ``--help``, exact outputs."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from laps.doc_help import doc_parser, plain_text

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("rst", "plain"), [
    (":func:`loadgen.simulate.simulate_run`", "`loadgen.simulate.simulate_run`"),
    (":func:`~loadgen.simulate.simulate_run`", "`simulate_run`"),
    (":meth:`EngineQueueModel.slot_wait_s`", "`EngineQueueModel.slot_wait_s`"),
    (":meth:`~EngineQueueModel.slot_wait_s`", "`slot_wait_s`"),
    (":mod:`policies.ttft_model`", "`policies.ttft_model`"),
    (":class:`~loadgen.virtual.VirtualRun`", "`VirtualRun`"),
    (":data:`ANCHORS`", "`ANCHORS`"),
    (":attr:`~a.b.c`", "`c`"),
    (":py:func:`~a.b`", "`b`"),
    (":ref:`the engine model <engine-model>`", "`the engine model`"),
    (":func:`fit <engines.sim.calibration.fit_latency>`", "`fit`"),
    ("``laps simulate --dataset``", "`laps simulate --dataset`"),
    ("``--pd`` adds the PD runs of ``mixed`` and ``docs``.", "`--pd` adds the PD runs of `mixed` and `docs`."),
    ("``bench/steady_state.py\n--ignore-eos``", "`bench/steady_state.py\n--ignore-eos`"),
    ("(:class:`~a.B`, ``x``; :mod:`c.d`)", "(`B`, `x`; `c.d`)"),
])
def test_plain_text_shows_each_role_and_literal_as_its_text_in_backticks(rst, plain):
    assert plain_text(rst) == plain


@pytest.mark.parametrize("text", [
    "",
    "no markup at all",
    "a `single` backtick, a ratio 3:1, key: value, ~a.b.c, <target>, a:b:c",
    "    python bench/dominance.py --out runs/d.json   # ~1 h\n\n* item\n  indented: `x`\n",
])
def test_plain_text_leaves_other_text_as_is(text):
    assert plain_text(text) == text


def test_plain_text_keeps_line_breaks_and_indentation_around_markup():
    rst = "First line ``a``.\n\n  * :func:`~m.f` (see\n    :mod:`m`)\n"
    assert plain_text(rst) == "First line `a`.\n\n  * `f` (see\n    `m`)\n"


DOC = "What it does, :func:`~m.run`.\n\n    python x.py --out o.json\n\nMore: ``--quick``.\n"


def test_doc_parser_splits_the_first_paragraph_from_the_rest():
    parser = doc_parser(DOC, prog="x.py")
    assert (parser.prog, parser.description, parser.epilog) == (
        "x.py", "What it does, `run`.", "    python x.py --out o.json\n\nMore: `--quick`.\n")
    assert parser.formatter_class is argparse.RawDescriptionHelpFormatter


def test_doc_parser_whole_doc_as_description_or_no_epilog():
    whole = doc_parser(DOC, split=False)
    assert (whole.description, whole.epilog) == (
        "What it does, `run`.\n\n    python x.py --out o.json\n\nMore: `--quick`.\n", None)
    first = doc_parser(DOC, epilog=None, formatter_class=argparse.HelpFormatter)
    assert (first.description, first.epilog, first.formatter_class) == ("What it does, `run`.", None, argparse.HelpFormatter)
    assert doc_parser("One paragraph, ``x``.").epilog is None
    assert doc_parser(DOC, split=False, epilog="example: ``y``").epilog == "example: `y`"


def test_dominance_help_shows_no_markup():
    result = subprocess.run([sys.executable, "bench/dominance.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: dominance.py")
    for markup in ("``", ":func:`", ":meth:`", ":mod:`", ":class:`", ":data:`", ":attr:`"):
        assert markup not in result.stdout
    assert "`laps simulate`" in result.stdout  # a literal of its docstring, now in single backticks


def test_every_bench_script_that_uses_doc_parser_imports_it_from_the_installed_package():
    # `python bench/NAME.py`, `python -m bench.NAME` and `import bench.NAME` put different folders on sys.path; only an
    # installed package resolves the same in all three (bench/gpu_check.py is copied alone to the GPU machine and
    # keeps its own parser).
    users = [p for p in sorted((ROOT / "bench").glob("*.py")) if "doc_parser(" in p.read_text()]
    assert len(users) >= 20  # bench/*.py with a command line, bar gpu_check.py
    for path in users:
        imports = [line.strip() for line in path.read_text().splitlines() if "import doc_parser" in line]
        assert imports and all(line.startswith("from laps.doc_help import doc_parser") for line in imports), path.name


def test_a_bench_script_runs_as_a_module_too():
    result = subprocess.run([sys.executable, "-m", "bench.sorted_f_table", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "``" not in result.stdout and ":func:`" not in result.stdout
