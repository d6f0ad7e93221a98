"""Error of the output-length predictor (``policies/output_predictor.py``) on real multi-turn chats.

    python bench/output_predictor_error.py --out runs/output_predictor_error.json    # ~1 s

Data: the hh-rlhf conversations (``loadgen/data``, the only data set here with real assistant
replies in multi-turn chats), reply lengths in Qwen2.5 tokens as the ``hh-rlhf`` workload counts
them. The prior is fitted on the even-numbered conversations (median reply; pseudo-count chosen
from 0.5/1/2/4/8 by MAE on the training half) and every figure is measured on the odd-numbered
ones. Each turn is predicted from the replies before it in its conversation, with the client's
``max_tokens`` cap; the true output is ``min(real reply, cap)``. Predictors compared:

* ``max_tokens``: the cap itself (what a scheduler without a predictor reserves; SGLang's
  reservation with ``ignore_eos``);
* ``prior``: the constant prior, capped (no history);
* ``history``: the shrunk per-conversation mean, capped (the predictor's default).

Printed per cap (256, 1024, 4096): MAE (tokens), mean relative error |ô − o| / o, and the
mean signed error (bias), on all turns and on turns with history (k >= 1).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from laps.doc_help import doc_parser  # noqa: E402
from laps.tokenizer import load_tokenizer  # noqa: E402
from loadgen.workloads import Conversation, load_hh_rlhf  # noqa: E402
from policies.output_predictor import OutputPredictor  # noqa: E402

CAPS = (256, 1024, 4096)
WEIGHTS = (0.5, 1.0, 2.0, 4.0, 8.0)


def replies(conversations: list[Conversation]) -> list[list[int]]:
    """Real reply lengths (tokens) per conversation, in turn order."""
    return [[t.max_tokens for t in c.turns] for c in conversations]


def errors(predictor: OutputPredictor | None, chats: list[list[int]], cap: int) -> dict[str, float]:
    """MAE, mean relative error and bias of ``predictor`` (None: predict the cap) on ``chats``."""
    abs_all, rel_all, signed_all, abs_hist = [], [], [], []
    for lengths in chats:
        for k, real in enumerate(lengths):
            truth = min(real, cap)
            guess = cap if predictor is None else predictor.predict(cap, lengths[:k])
            abs_all.append(abs(guess - truth))
            rel_all.append(abs(guess - truth) / truth)
            signed_all.append(guess - truth)
            if k:
                abs_hist.append(abs(guess - truth))
    return {"mae_tokens": statistics.fmean(abs_all), "mean_relative_error": statistics.fmean(rel_all),
            "bias_tokens": statistics.fmean(signed_all), "mae_tokens_with_history": statistics.fmean(abs_hist),
            "turns": len(abs_all), "turns_with_history": len(abs_hist)}


def fit(train: list[list[int]]) -> OutputPredictor:
    """Prior = median training reply; weight = the best of :data:`WEIGHTS` by training MAE (no cap)."""
    prior = float(statistics.median(x for lengths in train for x in lengths))
    best = min(WEIGHTS, key=lambda w: errors(OutputPredictor("history", prior, w), train, 10**9)["mae_tokens"])
    return OutputPredictor("history", prior, best)


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__, epilog=None)
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    args = parser.parse_args(argv)
    chats = replies(load_hh_rlhf(load_tokenizer(None)))
    train, test = chats[0::2], chats[1::2]
    fitted = fit(train)
    predictors = {"max_tokens": None, "prior": OutputPredictor("history", fitted.prior_tokens, 1e9), "history": fitted}
    results = {cap: {name: errors(p, test, cap) for name, p in predictors.items()} for cap in CAPS}
    out = {"fitted": {"prior_tokens": fitted.prior_tokens, "prior_weight": fitted.prior_weight},
           "default": {"prior_tokens": OutputPredictor().prior_tokens, "prior_weight": OutputPredictor().prior_weight},
           "test_conversations": len(test), "by_cap": {str(c): r for c, r in results.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))

    table = Table(title=f"Output-length prediction on hh-rlhf (test: {len(test)} conversations; "
                        f"fitted prior {fitted.prior_tokens:g} tokens, weight {fitted.prior_weight:g})")
    for col in ("max_tokens cap", "predictor", "MAE tokens", "MAE, turns k>=1", "mean |err|/o", "bias tokens", "MAE vs cap-only"):
        table.add_column(col, justify="right")
    for cap, by_name in results.items():
        base = by_name["max_tokens"]["mae_tokens"]
        for name, e in by_name.items():
            table.add_row(str(cap), name, f"{e['mae_tokens']:.1f}", f"{e['mae_tokens_with_history']:.1f}",
                          f"{e['mean_relative_error']:.2f}", f"{e['bias_tokens']:+.1f}", f"{e['mae_tokens'] / base:.3f}")
    console = Console(width=150)
    console.print(table)
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
