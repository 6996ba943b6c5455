"""The ``kv-canary`` command line (also ``python -m canary``)."""
from __future__ import annotations

import argparse
import functools

from canary import __version__

from . import replay


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-canary", description="KV-cache corruption canary: planning kernels.")
    parser.add_argument("--version", action="version", version=f"kv-canary {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser(
        "replay",
        help="replay a serving trace through a scheduler simulator and the planner",
        description="Replay a request trace through a continuous-batching scheduler simulator (paged KV pool, "
        "chunked prefill, CUDA-graph padding) and build the canary plan of every step.",
    )
    replay.add_arguments(p)
    p.set_defaults(func=replay.run, check=functools.partial(replay.check_arguments, p))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 mismatches, 2 usage or setup error)."""
    args = build_parser().parse_args(argv)
    args.check(args)
    return args.func(args)
