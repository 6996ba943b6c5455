"""The options of ``kv-canary replay``: each checked as it is parsed (argparse types), then the constraints
between them (:func:`check_arguments`), all before any work."""
from __future__ import annotations

import argparse
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from .faults import KINDS, parse_inject, requirement
from .plot import NEEDS_MATPLOTLIB, formats, suffix
from .scheduler import BUNDLED_TRACES

# Every size below counts slots, rows or tokens of int32-indexed tables (req_to_token holds int32 slots; the
# plans' counters are int32), so none may pass the int32 range.
INT32_MAX = (1 << 31) - 1


def _integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``; argparse prefixes its message with the option's name."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"expected an integer <= {high} (the int32 range), got {value}")
        return value

    return parse


_count, _size = _integer(0), _integer(1, INT32_MAX)
_count32 = _integer(0, INT32_MAX)


def _trace(text: str) -> str:
    """An argparse type: a bundled trace name, or a readable file (its content is checked at set-up)."""
    if text in BUNDLED_TRACES or text in BUNDLED_TRACES.values():
        return text
    path = Path(text)
    want = f"{', '.join(BUNDLED_TRACES)} or a trace CSV file"
    if not path.exists():
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r} (no such file)")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r} (not a file)")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r} (not readable)")
    return text


def _out_path(text: str) -> str:
    """An argparse type: a path where the summary (``--json``) or the plot (``--plot``) can be written, checked
    now so that a long run cannot fail at its end. Both are written atomically (a temporary file in the same
    directory, then renamed over the path: :func:`canary.replay.report.write_atomic`), so the test is to
    create such a file there: permission bits
    alone miss a read-only mount for root. A FIFO, device or directory is refused (a FIFO would block the
    write forever); a symbolic link is followed (its target is the file replaced)."""
    want = "a regular file path in an existing, writable directory"
    target = Path(os.path.realpath(text))
    if target.is_dir():
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r} (a directory)")
    if target.exists() and not stat.S_ISREG(target.stat().st_mode):
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r} (not a regular file: a FIFO, socket or "
                                         f"device)")
    folder = target.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r} (no directory {str(Path(text).parent)!r})")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{target.name}.", suffix=".tmp"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r} (cannot create a file in {str(folder)!r}: "
                                         f"{exc.strerror or exc})") from None
    return text


class _Once(argparse.Action):
    """``store`` (or, with ``nargs=0``, ``store_const``) that refuses a second use of its option: argparse would
    keep the last value silently, and ``--trace a.csv ... --trace b.csv`` is a mistake, not a choice. Records
    the options given in ``namespace.given`` (dest: the option as typed), for :func:`check_arguments`."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = vars(namespace).setdefault("given", {})
        if self.dest in given:
            used = given[self.dest]
            also = "" if used == option_string else f" (as {used})"
            parser.error(f"argument {option_string}: expected once, got it twice{also}")
        given[self.dest] = option_string
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", action=_Once, type=_trace, default="conv", metavar="PATH|conv|code",
                   help="trace CSV (columns TIMESTAMP, ContextTokens, GeneratedTokens), or a bundled Azure 2023 "
                   "trace: conv (default) or code")
    p.add_argument("--max-requests", action=_Once, type=_count, default=300, metavar="N",
                   help="replay the first N requests; 0 = all (default 300)")
    p.add_argument("--max-batch-size", action=_Once, type=_size, default=64, metavar="N",
                   help="running requests per step (default 64)")
    p.add_argument("--kv-pool-tokens", action=_Once, type=_size, default=1 << 17, metavar="N",
                   help="full KV pool size in tokens, at least 2 pages (default 131072)")
    p.add_argument("--verify-capacity", action=_Once, type=_count32, default=None, metavar="N",
                   help="verify entries per plan; 0 = 60%% of the KV pool, rounded down to 1024 (default)")
    p.add_argument("--verify-budget", action=_Once, type=_count32, default=None, metavar="N",
                   help="the same as --verify-capacity: verify entries per plan; a step asking more verifies a "
                   "rotating sample of N (or nothing with --on-overflow skip), so it trades verify cost for "
                   "staleness (see the canary's coverage rows)")
    p.add_argument("--on-overflow", action=_Once, choices=("sample", "skip"), default="sample",
                   help="a step whose verify entries exceed the capacity: sample = verify a rotating sample of "
                   "capacity entries (default, SPEC 3.7); skip = verify nothing (SGLang's behaviour)")
    p.add_argument("--chunk-size", action=_Once, type=_size, default=2048, metavar="N",
                   help="prefill tokens per request per step (default 2048)")
    p.add_argument("--token-budget", action=_Once, type=_count32, default=0, metavar="N",
                   help="tokens per step, decodes first; 0 = no limit (default)")
    p.add_argument("--page-size", action=_Once, type=_size, default=16, metavar="N",
                   help="KV page size in tokens (default 16)")
    p.add_argument("--swa-window", action=_Once, type=_count32, default=0, metavar="W",
                   help="plan a sliding-window group of window W through a full-to-SWA LUT; 0 = full attention")
    p.add_argument("--no-pad", dest="pad", action=_Once, nargs=0, const=False, default=True,
                   help="do not pad batches to CUDA-graph sizes (1, 2, 4, ..., max batch size)")
    p.add_argument("--backend", action=_Once, default="auto", choices=("auto", "reference", "cupy", "numba"),
                   help="planner backend; auto = a GPU backend if a GPU is present, else reference (default)")
    p.add_argument("--seed", action=_Once, type=_count, default=0, metavar="N",
                   help="seed of every random choice (default 0)")
    p.add_argument("--check-every", action=_Once, type=_count, default=0, metavar="N",
                   help="every N steps also plan with the reference backend and compare all output buffers "
                   "byte for byte; 0 = never (default)")
    p.add_argument("--plan-only", action=_Once, nargs=0, const=True, default=False,
                   help="only plan every step (no canary, no CanaryManager): the planner's checks alone")
    p.add_argument("--inject", action="append", type=parse_inject, default=[], metavar="KIND@STEP",
                   help=f"inject a fault at STEP (or the first later step where it applies); KIND: {', '.join(KINDS)}; "
                   "repeatable; not with --plan-only")
    p.add_argument("--offload-tier", action=_Once, type=_count32, default=0, metavar="TOKENS",
                   help="a host tier of TOKENS token slots: decoding requests are preempted into it (their KV and "
                   "records offloaded, pages freed) and restored into new pages later (docs/replay.md); 0 = off "
                   "(default); not with --swa-window")
    p.add_argument("--pd", action=_Once, nargs=0, const=True, default=False,
                   help="a prefill instance and a decode instance, each with its own KV pool and canary: a request's "
                   "KV and records are transferred after its prefill, under a block digest (docs/replay.md); not "
                   "with --offload-tier, --swa-window, --check-every, --plot or --plan-only")
    p.add_argument("--num-layers", action=_Once, type=_size, default=1, metavar="L",
                   help="KV layers of the simulated model; L >= 2 turns on the layer rotation (docs/integration.md "
                   "5c; default 1: layer 0 only, as SGLang)")
    p.add_argument("--layer-dwell", action=_Once, type=_size, default=1, metavar="D",
                   help="steps each layer stays under the rotation's cursor (with --num-layers; use the sampling "
                   "bound when the verify samples: docs/integration.md 5c; default 1)")
    p.add_argument("--ranks", action=_Once, type=_integer(1, 64), default=1, metavar="N",
                   help="N tensor-parallel ranks, one process each (gloo on the CPU, NCCL with one GPU a rank; "
                   "needs torch): the same schedule, each rank's own KV heads and manager, their agreement "
                   "checked each step; rank 0 reports for all (docs/replay.md; default 1)")
    p.add_argument("--json", action=_Once, type=_out_path, metavar="PATH",
                   help="also write the summary as JSON to PATH (its directory must exist and be writable; written "
                   "atomically; docs/replay.md lists its keys)")
    p.add_argument("--plot", action=_Once, type=_out_path, metavar="PATH",
                   help="also draw the run to PATH (needs matplotlib): verify entries per step against the budget, "
                   "staleness, and each injected fault's applied and detected steps; the format is PATH's suffix "
                   "(.png, .pdf, .svg, ...); checked and written as --json")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The constraints between options, after parsing; ``p.error`` exits 2 like argparse's own checks. Options
    that would change nothing (or a fault that could never be applied) are refused rather than ignored: a run
    that quietly ignores one reads as a run that tested it."""
    given = getattr(args, "given", {})
    if args.kv_pool_tokens < 2 * args.page_size:
        # Page 0 is reserved for the padding slot: a pool needs one more page to hold anything.
        p.error(f"argument --kv-pool-tokens: expected at least 2 pages of --page-size {args.page_size} "
                f"({2 * args.page_size} tokens), got {args.kv_pool_tokens}")
    cap, budget = args.verify_capacity, args.verify_budget
    if cap is not None and budget is not None and cap != budget:
        p.error(f"argument --verify-budget: expected the value of --verify-capacity ({cap}) when both are given, "
                f"got {budget}")
    if args.plan_only:
        if args.inject:
            p.error("argument --inject: expected the canary, got --plan-only (a fault needs the canary to be caught)")
        for dest in ("num_layers", "layer_dwell"):  # the layers are the canary's: the plans alone read none
            if dest in given:
                p.error(f"argument {given[dest]}: expected the canary (the layer rotation is the canary's), got "
                        f"--plan-only")
    if "layer_dwell" in given and args.num_layers < 2:
        p.error(f"argument --layer-dwell: expected --num-layers >= 2 (the layer rotation it paces), got "
                f"--num-layers {args.num_layers}")
    if args.offload_tier and args.swa_window:
        p.error(f"argument --offload-tier: expected full attention (no --swa-window), got --swa-window "
                f"{args.swa_window} (the tier moves whole prefixes; an SWA pool frees the pages out of its window)")
    if args.pd:
        _check_pd(p, args, given)
    for f in args.inject:
        need = requirement(f.kind, swa_window=args.swa_window, num_layers=args.num_layers,
                           offload_tier=args.offload_tier, pd=args.pd, ranks=getattr(args, "ranks", 1))
        if need:
            p.error(f"argument --inject: {f.kind}@{f.requested_step} needs {need}, which this run does not have "
                    f"(it could never be applied)")
    if getattr(args, "ranks", 1) > 1:
        from .ranks import check_ranks  # noqa: PLC0415 (the launcher's checks; torch is looked up, not imported)

        check_ranks(p, args)
    if getattr(args, "plot", None):
        _check_plot(p, args)
    for dest, what in (("json", "summary"), ("plot", "plot")):
        path = getattr(args, dest, None)
        if path and args.trace not in BUNDLED_TRACES and os.path.exists(path) and os.path.samefile(path, args.trace):
            p.error(f"argument --{dest}: expected a path other than the trace's, got {path!r} (the {what} would "
                    f"replace the trace)")
    # One value from here on: the budget is another name for the capacity.
    args.verify_capacity = budget if budget is not None else cap or 0


def _check_pd(p: argparse.ArgumentParser, args: argparse.Namespace, given: dict) -> None:
    """``--pd``: the options its loop (canary/replay/pd.py) does not support are refused, not ignored."""
    for dest, why in (("offload_tier", "the decode instance has no host tier"),
                      ("swa_window", "the transfer moves whole prompts of a full-attention pool"),
                      ("check_every", "the two instances' plans are not compared with the reference"),
                      ("plot", "the plot draws one instance's steps"),
                      ("plan_only", "the transfer is checked by the two instances' canaries")):
        if getattr(args, dest, None) and dest in given:
            p.error(f"argument {given[dest]}: expected it off with --pd ({why}), got {given[dest]} "
                    f"{getattr(args, dest)}")
    if getattr(args, "ranks", 1) > 1:
        p.error(f"argument --ranks: expected 1 with --pd (each instance is one rank; the transfer is not split "
                f"over ranks), got --ranks {args.ranks}")


def _check_plot(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--plot``: matplotlib is there, it writes the suffix's format, and the path is not ``--json``'s."""
    known = formats()
    if known is None:
        p.error(NEEDS_MATPLOTLIB)
    if suffix(args.plot) not in known:
        names = ", ".join(f".{s}" for s in sorted(known))
        p.error(f"argument --plot: expected a file name ending in a format matplotlib writes ({names}), got "
                f"{args.plot!r}")
    if args.json and os.path.realpath(args.json) == os.path.realpath(args.plot):
        p.error(f"argument --plot: expected a path other than --json's, got {args.plot!r} (one would replace the "
                f"other)")
