"""``python -m engines.sim``: run one simulated SGLang engine (see ``--help``)."""

from __future__ import annotations

import logging
import sys

from engines.sim.args import build_parser, parse_server_args, resolve_args
from engines.sim.server import run


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, serve until SIGINT/SIGTERM; 0 on a clean shutdown, 2 on bad arguments."""
    try:
        args = parse_server_args(sys.argv[1:] if argv is None else argv)
        resolve_args(args)
    except ValueError as err:
        build_parser().error(str(err))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
