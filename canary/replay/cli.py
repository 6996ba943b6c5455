"""The ``kv-canary`` command line (also ``python -m canary``)."""
from __future__ import annotations

import argparse
import ctypes
import functools
import sys

from canary import __version__

from . import options, replay


class Parser(argparse.ArgumentParser):
    """argparse, with the command's one error style: the usage, then ``kv-canary: MESSAGE`` on stderr, exit 2
    (the same prefix and stream as the set-up errors of :func:`canary.replay.replay.run`)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"kv-canary: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kv-canary",
        description="kv-canary, a KV-cache corruption canary: replays a serving trace through a simulated "
        "engine with the canary on every step (docs/replay.md).")
    parser.add_argument("--version", action="version", version=f"kv-canary {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    p = commands.add_parser(
        "replay",
        help="replay a serving trace through a scheduler simulator and the canary",
        description="Replay a request trace through a continuous-batching scheduler simulator (paged KV pool, "
        "chunked prefill, CUDA-graph padding) whose engine runs the canary through CanaryManager on every step "
        "(--plan-only: the plans alone), and report what it verified and detected.",
    )
    options.add_arguments(p)
    p.set_defaults(func=replay.run, check=functools.partial(options.check_arguments, p))
    return parser


def keep_freed_memory() -> None:
    """Ask glibc's allocator to keep freed memory for reuse. The NumPy reference allocates and frees the same
    large per-step arrays (megabytes) every step; by default glibc hands each back to the kernel (munmap) and the
    next step page-faults it in again: 5 million faults and 9 s of system time in a 32 s default replay on two
    cores, 0.2 s with this. A tuning of this process only (the library never calls it); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: heap, not mmap, for blocks up to 32 MiB (glibc's maximum)
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of free heap top
        libc.mallopt(-2, 64 << 20)  # M_TOP_PAD: grow the heap 64 MiB at a time
    except (OSError, AttributeError):  # not glibc (musl, ...): keep its defaults
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 mismatches or a missed fault, 2 usage, input or
    setup error, 130 interrupted). Argument errors raise ``SystemExit(2)`` (argparse's way)."""
    try:
        args = build_parser().parse_args(argv)
        args.check(args)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # what --ranks gives each rank's process
        keep_freed_memory()
        return args.func(args)
    except KeyboardInterrupt:  # before the replay's loop (which reports its partial summary itself)
        print("kv-canary: interrupted", file=sys.stderr)
        return 130
