"""The ``laps`` command: serve the gateway, generate load, or run the demo."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata
import logging
import signal
import sys
from functools import partial
from pathlib import Path

EPILOG = """examples:
  laps serve                                   # gateway + engines of the repository's config.yaml (--config for another)
  laps loadgen --url http://127.0.0.1:8000 --dataset mixed --rate 2 --duration 60 --out runs/report.json
  laps calibrate --url http://127.0.0.1:30000 --out runs/cost_model.yaml
  laps simulate --dataset mixed --rate 2 --duration 600 --policy laps --out runs/sim.json   # virtual time
  laps demo --duration 60                      # start, load, report, stop
"""

LOG_LEVELS = ("debug", "info", "warning", "error")


def _setup_logging(level: str, log_file: Path | None = None, label: str | None = None) -> None:
    """Log at ``level`` to stderr and ``log_file``; ``label`` names the process in every line (a gateway worker's)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    process = f"[{label}] " if label else ""
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s %(levelname)s {process}%(name)s: %(message)s", handlers=handlers, force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request is noise
    # The format names no thread, process, task or source line: do not gather them for every record (the gateway
    # writes one per request). Python's logging HOWTO, "Optimization".
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = logging.logAsyncioTasks = False
    logging._srcfile = None


def _run(coro) -> None:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency, but the gateway also runs on the stock loop
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def _cmd_serve(args: argparse.Namespace) -> int:
    from gateway.app import StartInterrupted, serve
    from laps.config import DEFAULT_CONFIG_PATH, load_config, parse_config
    from laps.tokenizer import load_tokenizer

    config = load_config(args.config)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("workers", args.workers)) if v is not None}
    if overrides:  # validated again: a port may clash with a KV bootstrap port
        data = config.model_dump(exclude_unset=True)
        data["gateway"] = {**data.get("gateway", {}), **overrides}
        given = "/".join(f"--{k}" for k in overrides)
        config = parse_config(data, f"{args.config or DEFAULT_CONFIG_PATH} with {given}")
    try:
        _setup_logging(args.log_level, config.log_dir / "gateway.log")
    except OSError as err:
        print(f"laps: log_dir {config.log_dir}: cannot write the gateway's log there ({err.strerror or err})", file=sys.stderr)
        return 2
    try:  # before any engine starts; cached, so the gateway's start-up reuses it
        load_tokenizer(config.model.path)
    except ValueError as err:
        print(f"laps: {err}", file=sys.stderr)
        return 2
    try:
        if config.gateway.workers == 1:
            _run(serve(config))
            return 0
        from gateway.workers import serve_workers

        return serve_workers(config, partial(_setup_logging, args.log_level, config.log_dir / "gateway.log"))
    except StartInterrupted as err:  # logged when it came; the engines started are stopped
        return 128 + (err.signum or signal.SIGINT)
    except (RuntimeError, OSError) as err:
        logging.getLogger("laps").error("%s", err)
        return 1


def _delegate(module: str, function: str = "main"):
    """A subcommand that sets up logging and runs ``module.function(args)``, imported only when used."""

    def command(args: argparse.Namespace) -> int:
        _setup_logging(args.log_level)
        return getattr(importlib.import_module(module), function)(args)

    return command


def _version() -> str:
    """The installed laps distribution's version (``pip install -e .``); a checkout run without it has none."""
    try:
        return importlib.metadata.version("laps")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    """``--log-level`` on ``parser``, ``default`` when not given (:data:`argparse.SUPPRESS`: no attribute set)."""
    parser.add_argument("--log-level", default=default, choices=LOG_LEVELS,
                        help="log verbosity, before or after the subcommand (default: info)")


def build_parser() -> argparse.ArgumentParser:
    """The ``laps`` argument parser with its subcommands."""
    from laps.calibrate import configure_parser as configure_calibrate
    from laps.config import DEFAULT_CONFIG_PATH
    from loadgen.cli import configure_parser as configure_loadgen
    from loadgen.cli import configure_simulate_parser, output_file, positive_float, seed_value

    parser = argparse.ArgumentParser(
        prog="laps",
        description="laps: a length-aware LLM gateway. Short prefills never wait behind long ones.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _add_log_level(parser, "info")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,loadgen,simulate,calibrate,demo}")

    serve = sub.add_parser(
        "serve",
        help="run the gateway and the engines of a config file",
        description="Start every engine of the config, then serve the OpenAI API in front of them until Ctrl-C.",
        epilog="examples:\n  laps serve --config config.yaml --port 8000\n  laps serve --workers 4        # 4 gateway processes on the port, one scheduler\n"
               "  curl http://127.0.0.1:8000/v1/models",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH, help="deployment YAML (default: %(default)s)")
    serve.add_argument("--host", help="override gateway.host")
    serve.add_argument("--port", type=int, help="override gateway.port")
    serve.add_argument("--workers", type=int, metavar="N",
                       help="override gateway.workers: N gateway processes share the port and one scheduler process decides "
                            "for all of them (default: the config's, 1 = one process)")
    serve.set_defaults(func=_cmd_serve)

    lg = sub.add_parser(
        "loadgen",
        help="send open-loop Poisson load of real chats to a gateway and report TTFT/TPOT/E2E",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_loadgen(lg)
    lg.set_defaults(func=_delegate("loadgen.cli"))

    sim = sub.add_parser(
        "simulate",
        help="run a workload through the config's gateway policies and engine models in virtual time",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_simulate_parser(sim)
    sim.set_defaults(func=_delegate("loadgen.cli", "simulate_main"))

    cal = sub.add_parser("calibrate", help="measure an engine's prefill times and fit the short/long boundary L_m(H)")
    configure_calibrate(cal)
    cal.set_defaults(func=_delegate("laps.calibrate"))

    demo = sub.add_parser(
        "demo",
        help="start the default deployment, run the mixed real-chat workload, report, stop",
        description="Start the gateway and its engines, run the mixed real-chat workload against them, "
        "print the report, write JSON and a TTFT plot, then shut everything down.",
        epilog="example:\n  laps demo --duration 60 --out runs/demo/report.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH, help="deployment YAML (default: %(default)s)")
    demo.add_argument("--duration", type=positive_float, default=60.0, help="seconds of load (default: %(default)s)")
    demo.add_argument("--rate", type=positive_float, default=3.0, help="conversation arrivals per second (default: %(default)s)")
    demo.add_argument("--seed", type=seed_value, default=0, help="workload seed (default: %(default)s)")
    demo.add_argument("--out", type=output_file, default=Path("runs/demo/report.json"),
                      help="report JSON; the PNG goes next to it; checked before anything starts (default: %(default)s)")
    demo.set_defaults(func=_delegate("laps.demo", "run_demo"))
    for subcommand in sub.choices.values():  # after the subcommand too; not given there, the one before it stands
        _add_log_level(subcommand, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``laps`` console script; returns the exit code."""
    # Every import happens in here (laps.config alone takes ~0.6 s), so a Ctrl-C while they run ends quietly too.
    try:
        from laps.config import ConfigError

        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:  # first: ConfigError is unbound when the Ctrl-C came during its import
        return 130
    except ConfigError as err:
        print(f"laps: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
