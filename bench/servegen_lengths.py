"""A token-count CSV for ``--dataset lengths:PATH`` drawn from a ServeGen length distribution.

    python bench/servegen_lengths.py --pmf /work/shared/data/servegen_length_pmf.csv \\
        --workload language/m-large --rows 6000 --out runs/servegen_mlarge.csv
    python bench/held_out.py --dataset lengths:runs/servegen_mlarge.csv --loads 100 200 300 400 500 \\
        --out runs/held_out/servegen_mlarge.json

ServeGen (alibaba/ServeGen, Apache-2.0) publishes per-client length distributions, not request logs; the
project's shared data folder (``/work/shared/data``, not shipped) has ``servegen_length_pmf.csv``, which sums them
into one request-weighted pmf per workload over power-of-two token bins (columns
``workload,field,bin_lo_incl,bin_hi_excl,prob``, ``field`` one of ``input_tokens``, ``input_text_tokens``,
``output_tokens``). Each row written here draws its prompt and its
output independently (the pmfs are marginals: whatever correlation the requests had is lost), a bin by its
probability and then a length log-uniform within it, from a seeded generator.
"""

from __future__ import annotations

import csv
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from laps.doc_help import doc_parser  # noqa: E402
from loadgen.cli import positive_int  # noqa: E402

INPUT_FIELDS = ("input_tokens", "input_text_tokens")  # mm-image lists only its text tokens
OUTPUT_FIELD = "output_tokens"


def read_pmf(path: Path, workload: str) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]]]:
    """The input and output bins ``(lo_incl, hi_excl, prob)`` of ``workload`` in a ServeGen pmf CSV.

    Raises:
        ValueError: the file is not UTF-8 text, lacks a column, a bin is malformed (bounds not 0 <= lo < hi, prob
            outside [0, 1]), or ``workload`` has no input or no output bins (the message lists the workloads the file
            has).
        OSError: the file cannot be opened.
    """
    bins: dict[str, list[tuple[int, int, float]]] = {"input": [], "output": []}
    names = set()
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        try:
            rows = list(reader)
        except (csv.Error, UnicodeDecodeError) as err:
            raise ValueError(f"{path} line {max(1, reader.line_num)}: not CSV text ({err})") from None
        missing = {"workload", "field", "bin_lo_incl", "bin_hi_excl", "prob"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path} line 1: no column {', '.join(sorted(missing))}")
        for line_no, row in enumerate(rows, 2):
            names.add(row["workload"])
            if row["workload"] != workload:
                continue
            where = f"{path} line {line_no}"
            try:
                lo, hi, prob = int(row["bin_lo_incl"]), int(row["bin_hi_excl"]), float(row["prob"])
            except (TypeError, ValueError):  # TypeError: a row short of fields
                raise ValueError(f"{where}: a bin needs integer bounds and a numeric prob") from None
            if not (0 <= lo < hi and 0 <= prob <= 1):
                raise ValueError(f"{where}: bin [{lo}, {hi}) with prob {prob} is not a bin")
            if row["field"] in INPUT_FIELDS:
                bins["input"].append((lo, hi, prob))
            elif row["field"] == OUTPUT_FIELD:
                bins["output"].append((lo, hi, prob))
    for side in ("input", "output"):
        if not any(p > 0 for *_, p in bins[side]):
            raise ValueError(f"{path}: workload {workload!r} has no {side} bins with probability "
                             f"(workloads: {', '.join(sorted(names)) or 'none'})")
    return bins["input"], bins["output"]


def draw(bins: list[tuple[int, int, float]], rng: random.Random) -> int:
    """A length from ``bins``: a bin by probability, then log-uniform in [max(lo, 1), hi), as an integer < hi."""
    lo, hi, _ = rng.choices(bins, weights=[p for *_, p in bins])[0]
    lo = max(lo, 1)
    return min(hi - 1, int(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__, prog=Path(__file__).name)
    parser.add_argument("--pmf", type=Path, required=True, help="ServeGen length pmf CSV")
    parser.add_argument("--workload", required=True, help="its workload, e.g. language/m-large")
    parser.add_argument("--rows", type=positive_int, default=6000, help="requests to write (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="CSV to write: input_tokens,output_tokens")
    args = parser.parse_args(argv)
    try:
        inputs, outputs = read_pmf(args.pmf, args.workload)
    except OSError as err:
        parser.error(f"--pmf {args.pmf}: {err.strerror or err}")
    except ValueError as err:
        parser.error(str(err))
    rng = random.Random(args.seed)
    lines = [f"{draw(inputs, rng)},{draw(outputs, rng)}\n" for _ in range(args.rows)]
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("input_tokens,output_tokens\n" + "".join(lines), encoding="utf-8")
    except OSError as err:
        parser.error(f"--out {args.out}: {err.strerror or err}")
    print(f"wrote {args.rows} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
