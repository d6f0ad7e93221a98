"""Run by the SGLang environment's interpreter: parse command lines with SGLang's own parser.

Usage: ``python sglang_parse_args.py``, then one request per stdin line: a JSON object
``{"argvs": [...], "out": PATH}``, ``argvs`` a list of argument lists (``launch_server``'s
arguments, without the program). For each request it writes to ``PATH`` a JSON list with,
per argument list, ``null`` when ``sglang.srt.server_args.prepare_server_args`` accepts
it, else its error message, then prints :data:`DONE` on a line of its own (SGLang may
print to stdout too). It ends at the end of stdin. Importing SGLang takes ~20 s; one
process serves every test that asks (``tests.sglang_env.SGLangParser``). Needs no GPU.
"""

import contextlib
import io
import json
import sys

from sglang.srt.server_args import prepare_server_args

DONE = "laps-parse-done"


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
    for line in sys.stdin:
        request = json.loads(line)
        errors = [_error(argv) for argv in request["argvs"]]
        with open(request["out"], "w") as out:
            json.dump(errors, out)
        print(DONE, flush=True)


if __name__ == "__main__":
    main()
