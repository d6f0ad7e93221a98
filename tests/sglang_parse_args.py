"""Run by the SGLang environment's interpreter: parse command lines with SGLang's own parser.

Usage: ``python sglang_parse_args.py OUT.json`` with a JSON list of argument
lists (``launch_server``'s arguments, without the program) on stdin. Writes to
``OUT.json`` a JSON list with, per argument list, ``null`` when
``sglang.srt.server_args.prepare_server_args`` accepts it, else its error
message. Needs no GPU.
"""

import contextlib
import io
import json
import sys

from sglang.srt.server_args import prepare_server_args


def _error(argv: list[str]) -> str | None:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            prepare_server_args(argv)
    except SystemExit:  # argparse: unknown flag or bad value; its message is the last line
        lines = stderr.getvalue().strip().splitlines()
        return lines[-1] if lines else "argparse exited without a message"
    except Exception as err:  # ServerArgs' own checks
        return f"{type(err).__name__}: {err}"
    return None


def main() -> None:
    errors = [_error(argv) for argv in json.load(sys.stdin)]
    with open(sys.argv[1], "w") as out:
        json.dump(errors, out)


if __name__ == "__main__":
    main()
