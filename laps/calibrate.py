"""``laps calibrate``: measure an engine's prefill time over a grid of (L, H) and fit the cost model.

For each grid point a fresh random prefix of H token ids is sent first (one
output token) so the engine caches it; then the prefix plus L fresh random
token ids is timed end to end through ``/generate`` with one output token, which
is the prefill (the first token is sampled from the prefill's logits). The
median of the repeats is one sample; :func:`policies.cost_fit.fit_cost_model`
fits them and the result is written as the ``scheduling.cost_model`` block of
a laps config. Random ids come from a seeded generator, so runs are repeatable.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from engines.client import EngineClient, EngineHTTPError
from loadgen.cli import http_url, int_range, output_file, positive_int, seed_value
from loadgen.outputs import check_output_path, open_output
from policies.cost_fit import MIN_SAMPLES, CostFit, fit_cost_model

DEFAULT_NEW_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_CACHED_TOKENS = (0, 2048, 8192)
# Token ids drawn for prompts: ordinary vocabulary entries of Qwen2.5 (below the special tokens).
_TOKEN_ID_RANGE = (1000, 150000)

Measure = Callable[[list[int]], Awaitable[float]]


class CalibrationError(RuntimeError):
    """The engine did not answer a calibration request."""


def http_measure(client: EngineClient, url: str) -> Measure:
    """A :data:`Measure` that times ``POST url/generate`` with one output token, in seconds."""

    async def measure(input_ids: list[int]) -> float:
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        start = time.perf_counter()
        async with client.post(url, "/generate", body) as resp:
            payload = await resp.read()
            if resp.status != 200:
                hint = ("; this looks like an OpenAI server such as the laps gateway, not an SGLang engine: pass an engine's "
                        "URL (GET /admin/engines on the gateway, or its 'serving ... with N engines' log line)"
                        if resp.status == 404 and payload.lstrip().startswith(b'{"error"') else "")
                raise CalibrationError(f"{url}/generate answered HTTP {resp.status}: {payload[:300]!r}{hint}")
        return time.perf_counter() - start

    return measure


async def collect_samples(
    measure: Measure, new_tokens: Sequence[int], cached_tokens: Sequence[int], repeats: int, rng: random.Random, on_sample: Callable[[], None] | None = None
) -> list[tuple[int, int, float]]:
    """Median prefill seconds for every (L, H) of the grid: ``[(L, H, seconds), ...]``."""
    samples = []
    for h in cached_tokens:
        for n in new_tokens:
            times = []
            for _ in range(repeats):
                prefix = [rng.randrange(*_TOKEN_ID_RANGE) for _ in range(h)]
                if prefix:
                    await measure(prefix)
                times.append(await measure(prefix + [rng.randrange(*_TOKEN_ID_RANGE) for _ in range(n)]))
            samples.append((n, h, statistics.median(times)))
            if on_sample is not None:
                on_sample()
    return samples


def config_block(fit: CostFit) -> dict:
    """The fit as the ``scheduling.cost_model`` block of a laps config."""
    m = fit.model
    return {"scheduling": {"cost_model": {"alpha": m.alpha, "beta": m.beta, "gamma_w": m.gamma_w, "gamma_r": m.gamma_r, "memory_floor_s": m.memory_floor_s}}}


def write_fit(fit: CostFit, samples: Sequence[tuple[int, int, float]], url: str, out: Path) -> None:
    """Write the config block, with the samples and boundary as comments, to ``out`` (through
    :func:`~loadgen.outputs.open_output`: a failed write leaves an earlier file whole).

    Raises:
        OSError: the file or a folder cannot be written.
    """
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# laps calibrate --url {url}   ({when})",
        f"# {len(samples)} samples, RMS relative error {100 * fit.rms_relative_error:.1f}%, fixed overhead {1e3 * fit.overhead_s:.2f} ms",
        "# short/long boundary L_m(H): " + ", ".join(f"H={h}: {fit.model.boundary_tokens(h):.0f}" for h in sorted({s[1] for s in samples})),
        "# samples (L, H, ms): " + "; ".join(f"{n},{h},{1e3 * t:.2f}" for n, h, t in samples),
    ]
    with open_output(out) as f:
        f.write(("\n".join(lines) + "\n" + yaml.safe_dump(config_block(fit), sort_keys=False)).encode())


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add ``laps calibrate``'s flags to ``parser``."""
    parser.description = "Measure an engine's prefill time over a grid of new (L) and cached (H) tokens, fit the LAPS cost model, and write it as the scheduling.cost_model block of a laps config."
    parser.epilog = "example:\n  laps calibrate --url http://127.0.0.1:30000 --out runs/cost_model.yaml\n  # then paste the block into config.yaml (or merge it) to classify by L_m(H)"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--url", type=http_url, required=True, help="engine base URL (SGLang or the simulated engine), e.g. http://127.0.0.1:30000")
    parser.add_argument("--out", type=output_file, required=True, help="YAML file to write the fitted cost_model block to (checked before measuring)")
    parser.add_argument("--new-tokens", type=positive_int, nargs="+", default=list(DEFAULT_NEW_TOKENS),
                        help=f"grid of L, each >= 1; with --cached-tokens at least {MIN_SAMPLES} distinct (L, H) points (default: %(default)s)")
    parser.add_argument("--cached-tokens", type=int_range(0), nargs="+", default=list(DEFAULT_CACHED_TOKENS), help="grid of H, each >= 0 (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timings per grid point; the median counts (default: %(default)s)")
    parser.add_argument("--seed", type=seed_value, default=0, help="seed of the random prompts (default: %(default)s)")


async def run(args: argparse.Namespace) -> CostFit:
    """Measure, fit, print and write (see the module docstring).

    Raises:
        CalibrationError: the engine failed a request.
        ValueError: the grid gives fewer than :data:`~policies.cost_fit.MIN_SAMPLES` samples (:func:`main` refuses
            that before measuring: :func:`check_arguments`).
        OSError: ``--out`` cannot be written.
    """
    client = EngineClient(request_timeout_s=120.0)
    await client.start()
    try:
        with Progress(transient=True) as progress:
            task = progress.add_task("calibrating", total=len(args.new_tokens) * len(args.cached_tokens))
            samples = await collect_samples(
                http_measure(client, args.url.rstrip("/")), args.new_tokens, args.cached_tokens, args.repeats, random.Random(args.seed), lambda: progress.advance(task)
            )
    finally:
        await client.close()
    fit = fit_cost_model(samples)
    table = Table(title=f"prefill time of {args.url}")
    table.add_column("L new")
    for h in args.cached_tokens:
        table.add_column(f"H={h} ms (fit)", justify="right")
    by_point = {(n, h): t for n, h, t in samples}
    for n in args.new_tokens:
        fitted = {h: float(fit.predict_s(n, h)) for h in args.cached_tokens}
        table.add_row(str(n), *(f"{1e3 * by_point[n, h]:.2f} ({1e3 * fitted[h]:.2f})" for h in args.cached_tokens))
    console = Console()
    console.print(table)
    console.print(f"RMS relative error {100 * fit.rms_relative_error:.1f}%; boundary L_m(H): " + ", ".join(f"H={h}: {fit.model.boundary_tokens(h):.0f}" for h in args.cached_tokens))
    write_fit(fit, samples, args.url, args.out)
    console.print(f"wrote {args.out}")
    return fit


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, before measuring, a grid of fewer than :data:`~policies.cost_fit.MIN_SAMPLES` distinct (L, H) points
    and an ``--out`` that cannot be written (:func:`~loadgen.outputs.check_output_path`).

    Raises:
        ValueError: why, in one line naming the flags.
    """
    new, cached = len(set(args.new_tokens)), len(set(args.cached_tokens))
    if new * cached < MIN_SAMPLES:
        raise ValueError(f"--new-tokens × --cached-tokens: {new} × {cached} = {new * cached} distinct (L, H) points; "
                         f"fitting the cost model needs at least {MIN_SAMPLES}")
    check_output_path("--out", args.out)


def main(args: argparse.Namespace) -> int:
    """``laps calibrate`` entry point; 0 on success, 1 when the engine failed or the fit could not be written, 2 for
    arguments refused before measuring (:func:`check_arguments`)."""
    try:
        check_arguments(args)
    except ValueError as err:
        print(f"laps calibrate: {err}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run(args))
    except (CalibrationError, EngineHTTPError, OSError) as err:
        Console(stderr=True).print(f"[red]calibration failed:[/red] {err}")
        return 1
    return 0
