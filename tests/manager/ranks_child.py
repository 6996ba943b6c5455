"""One rank of tests/manager/test_manager_ranks.py: a gloo process group, a ToyEngine per scenario whose manager
agrees with the other ranks, what each rank's callback received written to ``OUT/rank<r>.json``.

``python ranks_child.py RANK WORLD PORT OUT TP``: ``TP`` tensor-parallel ranks a stage, ``WORLD // TP`` stages
(global rank ``r`` is ``tp_rank = r % TP``, ``pp_rank = r // TP``); one stage: the manager is given the TP
group's communicator alone, else ``{"tp": ..., "pp": ...}``.
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers.manager_engine import ToyEngine  # noqa: E402

from canary import CanaryViolationError, Ranks, TorchDistributedCommunicator  # noqa: E402
from canary.replay.ranks import end as end_rank  # noqa: E402

FAULTY = 1  # the global rank the faults are injected on


def main(rank: int, world: int, port: int, out: Path, tp: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=40))
    pp = world // tp
    tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]  # every rank makes each
    pp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    ranks = Ranks(tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=pp, dp_rank=0, dp_size=1)
    tp_comm = TorchDistributedCommunicator(tp_groups[rank // tp])
    comm = tp_comm if pp == 1 else {"tp": tp_comm, "pp": TorchDistributedCommunicator(pp_groups[rank % tp])}
    result = {}
    for scenario in ("clean", "flip", "lost_write"):
        import prometheus_client

        registry = prometheus_client.CollectorRegistry()
        got = []
        e = ToyEngine(ranks=ranks, communicator=comm, on_violation=got.append, metrics=registry)
        e.add("a", [5, 6, 7, 8])
        e.add("b", [9, 10])
        for _ in range(3):
            e.decode_step(["a", "b"])  # steps 0, 1, 2
        if scenario == "flip" and rank == FAULTY:
            e.flip("full", e.slot_of("a", 1))
        if scenario == "lost_write" and rank == FAULTY:
            store = e.manager.after_kv_store

            def lossy(*, out_cache_loc, **kw):  # the step's first write lost on this rank alone
                loc = np.array(out_cache_loc, copy=True)
                loc[0] = -1
                e.manager.after_kv_store = store
                store(out_cache_loc=loc, **kw)

            e.manager.after_kv_store = lossy
        e.decode_step(["a", "b"])  # step 3
        e.manager.flush()
        result[scenario] = {
            "reports": [{"step": v.step, "dropped": v.dropped, "records": [
                {"type": type(r).__name__, "reasons": list(r.reason_names), "group": r.group, "step": r.first_step,
                 "scope": getattr(r, "scope", None), "peers": list(getattr(r, "peers", ())),
                 "fields": list(getattr(r, "fields", ())), "line": r.line(),
                 "ranks": None if r.ranks is None else r.ranks.labels()} for r in v]} for v in got],
            "stats": e.manager.stats(),
            "metrics": [(s.name, s.labels, s.value) for m in registry.collect() for s in m.samples
                        if s.name == "kv_canary_steps_total"],
        }
        e.manager.close()
    # mode "raise": every rank raises at the same step boundary, the faulty rank's flip named everywhere
    e = ToyEngine(ranks=ranks, communicator=comm, on_violation="raise")
    e.add("a", [5, 6, 7])
    e.decode_step(["a"])
    if rank == FAULTY:
        e.flip("full", e.slot_of("a", 0))
    e.decode_step(["a"])  # step 1 sees the flip
    try:
        e.decode_step(["a"])  # step 2's boundary decodes step 1
        result["raise"] = None
    except CanaryViolationError as err:
        result["raise"] = {"step": err.step, "reasons": sorted(n for v in err.violations for n in v.reason_names)}
    e.manager.close()
    (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
    end_rank(0)  # without the interpreter's teardown (its docstring says why)
