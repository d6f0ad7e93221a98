"""``python -m loadgen ...``: the same as ``laps loadgen ...``."""

import argparse
import sys

from loadgen.cli import configure_parser, main

parser = argparse.ArgumentParser(prog="python -m loadgen")
configure_parser(parser)
sys.exit(main(parser.parse_args()))
