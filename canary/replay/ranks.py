"""``kv-canary replay --ranks N``: N tensor-parallel ranks, one process each, every rank the same schedule with
its own engine KV (other heads: bytes of ``(request, position, rank)``, :func:`canary.replay.engine.kv_bytes`) and
its own :class:`canary.CanaryManager` given ``Ranks(tp_rank=r, tp_size=N)`` and a
:class:`canary.TorchDistributedCommunicator`, so that the managers agree on every step (SPEC 4.3).

:func:`launch` is the command's own process: it starts the N rank processes (``python -m canary`` with the same
arguments, the rank in the environment), passes rank 0's output through, keeps the others' in log files (shown
when a rank fails), and stops the rest when a rank dies before the end (a rank missing from a collective would
block the others until the process group's timeout). Each rank process :func:`join` s a process group: gloo on the
CPU, NCCL with one GPU a rank (``N`` GPUs needed, refused otherwise). At the end :meth:`RankContext.merge` gathers
every rank's findings (violations, agreement statistics, each fault's detection) to rank 0, which reports them.
torch is needed (``import canary`` never imports it; the launcher only looks it up).

The ``rank-*`` fault kinds' hooks are here too (:mod:`canary.replay.faults` describes them; importing either module
adds them to its ``KINDS``): every rank picks the same request and slot, the last rank alone corrupts it.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .engine import EngineKV, StepData
from .faults import AFTER_WRITE, BEFORE_WRITE, KINDS, Fault, _candidates, _mid_window, _record, _window_too_small

RANK_ENV, WORLD_ENV, PORT_ENV = "KV_CANARY_REPLAY_RANK", "KV_CANARY_REPLAY_WORLD", "KV_CANARY_REPLAY_PORT"
COLLECTIVE_TIMEOUT_S = 300  # a rank missing from a collective fails the others after this long
GRACE_S = 5.0  # how long the other ranks may take to end once one has died
LOG_TAIL = 4000  # characters of a failed rank's log shown
NEEDS_TORCH = ("python -m pip install torch (the CPU build is enough for gloo: python -m pip install torch "
               "--index-url https://download.pytorch.org/whl/cpu)")


def check_ranks(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--ranks N`` (N >= 2) with the rest: the canary on, torch installed; ``p.error`` exits 2."""
    if args.plan_only:
        p.error(f"argument --ranks: expected the canary (the ranks' managers agree on each step), got --plan-only "
                f"with --ranks {args.ranks}")
    if importlib.util.find_spec("torch") is None:
        p.error(f"argument --ranks: expected torch for the ranks' process group with --ranks {args.ranks}, got no "
                f"torch: {NEEDS_TORCH}")


def is_worker() -> bool:
    """Whether this process is one of the ranks that :func:`launch` started."""
    return RANK_ENV in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpus() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, or no driver: _placement would not have chosen the GPU
        return 0


def launch(args: argparse.Namespace, kind: str) -> int:
    """Start ``args.ranks`` rank processes of ``args.argv`` and wait for them; ``kind``: the replay's array
    placement (``host``: gloo; ``cupy``: NCCL, one GPU a rank). Returns rank 0's exit status (that of a rank that
    died, when rank 0's is 0), 2 when the ranks cannot be placed."""
    n = args.ranks
    if kind == "numba":
        print(f"kv-canary: --ranks {n}: expected CuPy for the ranks' GPU arrays (one GPU a rank), got Numba device "
              f"arrays only (CuPy is missing or sees no GPU); on the CPU: --backend reference", file=sys.stderr)
        return 2
    if kind == "cupy" and _gpus() < n:
        print(f"kv-canary: --ranks {n}: expected {n} GPUs (one a rank, NCCL), got {_gpus()}; on the CPU (gloo): "
              f"--backend reference", file=sys.stderr)
        return 2
    return spawn([sys.executable, "-m", "canary", *args.argv], n)


def spawn(command: list[str], n: int) -> int:
    """Run ``command`` as ``n`` rank processes (each finds its rank, the world size and the port in the
    environment: :func:`is_worker`, :func:`join`) and wait for them; rank 0's output passes through, a failed
    rank's log tail goes to stderr. Returns rank 0's exit status (that of a rank that died, when rank 0's is 0)."""
    root = str(Path(__file__).resolve().parents[2])  # the rank processes import this very canary
    env = dict(os.environ, **{WORLD_ENV: str(n), PORT_ENV: str(_free_port())})
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")  # N processes on the host's cores: torch's threads would fight
    with tempfile.TemporaryDirectory(prefix="kv-canary-ranks-") as tmp:
        logs = [None] + [open(Path(tmp) / f"rank{r}.log", "w+") for r in range(1, n)]
        procs = []
        try:
            for r in range(n):
                out = None if r == 0 else logs[r]
                procs.append(subprocess.Popen(command, env={**env, RANK_ENV: str(r)}, stdout=out,
                                              stderr=subprocess.STDOUT if out else None))
            rcs = _wait(procs)
        except KeyboardInterrupt:  # the ranks got the SIGINT too (one process group): their partial reports
            rcs = [p.wait() for p in procs]
        for r in range(1, n):
            if rcs[r] not in (0, 1, 130):
                logs[r].seek(0)
                text = logs[r].read()[-LOG_TAIL:]
                print(f"kv-canary: --ranks {n}: rank {r} exited {rcs[r]}; its output:\n{text}", file=sys.stderr)
            logs[r].close()
    return rcs[0] if rcs[0] else max(rcs, key=abs)


def end(status: int) -> None:
    """End this rank process now, with ``status``, without the interpreter's teardown: gloo's threads, still alive
    while C++ statics are destroyed, can abort an exit whose work is done (status 134: a failed run)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(status or 0))


def _wait(procs: list[subprocess.Popen]) -> list[int]:
    """Wait for every rank; once one has died (status not 0, 1 or 130), the rest get ``GRACE_S`` to end, then are
    killed (they would wait in a collective for the one that died)."""
    died_at = None
    while True:
        rcs = [p.poll() for p in procs]
        if all(rc is not None for rc in rcs):
            return rcs
        if died_at is None and any(rc not in (None, 0, 1, 130) for rc in rcs):
            died_at = time.monotonic()
        if died_at is not None and time.monotonic() - died_at > GRACE_S:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return [p.wait() for p in procs]
        time.sleep(0.05)


class RankContext:
    """One rank's process group: ``rank`` of ``size``, ``ranks`` (:class:`canary.Ranks`) and ``communicator``
    (:class:`canary.TorchDistributedCommunicator`) for its manager, and the end's :meth:`merge`."""

    def __init__(self, rank: int, size: int, port: int, kind: str):
        import torch
        import torch.distributed as dist

        from canary import Ranks, TorchDistributedCommunicator

        self.dist, self.rank, self.size = dist, rank, size
        backend = "gloo"
        if kind == "cupy":  # one GPU a rank; the canary's arrays (CuPy) on the same one
            import cupy

            if not (torch.cuda.is_available() and dist.is_nccl_available()):
                raise RuntimeError(f"kv-canary: --ranks {size}: expected torch with CUDA and NCCL for GPU ranks, got "
                                   f"torch {torch.__version__} without them ({NEEDS_TORCH.split(' (')[0]} with CUDA)")
            torch.cuda.set_device(rank)
            cupy.cuda.Device(rank).use()
            backend = "nccl"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self.objects = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        self.ranks = Ranks(tp_rank=rank, tp_size=size)
        self.communicator = TorchDistributedCommunicator(dist.group.WORLD)

    def merge(self, summary: dict, problems: list[str]) -> tuple[dict, list[str]]:
        """Every rank's findings gathered (a collective: every rank calls it once, at the end): the summary gets
        ``canary.ranks`` (one entry a rank) and, a fault, ``detected_on_ranks`` and ``rank_delays``; the
        unattributed violations, mismatches and ``failed`` are those of all ranks. Returns what rank 0 reports."""
        c = summary.get("canary")
        part = {"rank": self.rank, "steps": summary["steps"], "mismatches": problems,
                "violations": None if c is None else c["violations"],
                "unattributed_violations": 0 if c is None else c["unattributed_violations"],
                "first_unattributed": [] if c is None else c["first_unattributed"],
                "agreement": None if c is None else c["manager"].get("agreement"),
                "faults": [] if c is None else [{k: f[k] for k in ("detected", "first_violation_step",
                                                                   "steps_to_detection", "reasons")}
                                                for f in c["faults"]],
                "failed": False if c is None else c["failed"]}
        parts: list[Any] = [None] * self.size
        self.dist.all_gather_object(parts, part, group=self.objects)
        problems = problems + [f"rank {p['rank']}: {line}" for p in parts[1:] for line in p["mismatches"]]
        summary["mismatches"] = len(problems)
        summary["ranks"] = self.size
        if c is not None:
            for i, f in enumerate(c["faults"]):
                f["detected_on_ranks"] = [p["rank"] for p in parts if p["faults"][i]["detected"]]
                f["rank_delays"] = [p["faults"][i]["steps_to_detection"] for p in parts]
            c["ranks"] = [{k: v for k, v in p.items() if k not in ("mismatches", "first_unattributed")} for p in parts]
            c["unattributed_violations"] = sum(p["unattributed_violations"] for p in parts)
            c["first_unattributed"] = [f"rank {p['rank']}: {line}" for p in parts for line in p["first_unattributed"]]
            # A fault counts as detected when every rank saw it (the agreement's promise), a clean run on none.
            c["failed"] = any(p["failed"] for p in parts) or any(len(f["detected_on_ranks"]) < self.size
                                                                 for f in c["faults"])
        return summary, problems

    def close(self) -> None:
        self.dist.barrier(group=self.objects)  # no rank tears the group down while another still reads from it
        self.dist.destroy_process_group()


def join(kind: str) -> RankContext:
    """This rank process's process group (the rank, size and port from :func:`launch`'s environment)."""
    return RankContext(int(os.environ[RANK_ENV]), int(os.environ[WORLD_ENV]), int(os.environ[PORT_ENV]), kind)


# -- the rank-* faults (canary.replay.faults lists them) --------------------------------------------------------------
def _faulty_rank(kv: EngineKV, f: Fault) -> bool | None:
    """Whether this engine is the rank a ``rank-*`` fault corrupts (the last); ``None``: no ranks to differ."""
    if kv.ranks_size < 2:
        f.needs = "--ranks >= 2"
        return None
    return kv.rank == kv.ranks_size - 1


def _rank_flip(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    mine = _faulty_rank(kv, f)
    if mine is None or _window_too_small(kv, f):
        return False
    for i, lo, end in _mid_window(kv, d, taken):
        q = (lo + end) // 2
        slot = kv.host_slot(int(d.rows[i]), q)
        if mine:
            kv.kv_token_bytes(slot)[5] ^= 0x04
        _record(f, d, slot=slot, position=q, requests=(i,), slots=(slot,))
        return True
    return False


def _rank_diverge(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    mine = _faulty_rank(kv, f)
    if mine is None:
        return False
    for i in _candidates(d, taken):
        if d.prefix[i] > 0:  # a position the next verify reads, with a chain predecessor
            k = d.last_entry(i)
            slot = int(d.out_cache_loc[k])
            if mine:
                d.out_cache_loc[k] = -1  # the write (record and KV store) lost on this rank alone
            _record(f, d, slot=slot, position=int(d.prefix[i] + d.extend[i]) - 1, requests=(i,), slots=(slot,))
            return True
    return False


def rank_fault_of(faults: list[Fault], step: int) -> int | None:
    """Index of the fault a :class:`canary.RankViolation` found at ``step`` belongs to: the one applied last at a
    step ``<= step`` (any kind: a fault on every rank is also some rank's violation), or ``None``."""
    best = None
    for k, f in enumerate(faults):
        if f.applied and f.applied_step <= step and (best is None or f.applied_step >= faults[best].applied_step):
            best = k
    return best


KINDS.update({"rank-diverge": (BEFORE_WRITE, _rank_diverge), "rank-flip": (AFTER_WRITE, _rank_flip)})
