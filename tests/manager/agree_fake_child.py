"""A GPU manager's agreement words (SPEC 4.3) on tests/helpers/fakecuda.py (host memory posing as a device), in its
own process: the fake CuPy must not meet the test session's imports. Run by ``test_manager_ranks.py``.

``python agree_fake_child.py kernel|copy``: the report through the report kernel or through copies and a memset.
What runs for real: the agreement launch's packing (pointers, lengths, widths, the plan's capacity), its place in
the step (direct, and inside the eager steps' replayed graphs), the words' place in the report block, their reset
behind every report and the decoder's read. The fake runs kernels/agree.cu's semantics through the host formula
(its bits are the sim suite's to check: tests/manager/agree_sim_suite.py); the planner launches nothing, so the
test fills each group's verify plan itself, as the plan kernel would. Prints ``OK``; a failure is an assertion.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT))

import fakecuda  # noqa: E402

fakecuda.install()

import cupy  # noqa: E402 - the fake

from canary import CanaryManager, KVGroup  # noqa: E402
from canary.contract.plans import MISSING_SLOT  # noqa: E402
from canary.manager.distributed import FIELDS, entries_digest, plan_digest  # noqa: E402


class Recorder:
    """One rank: returns the words, keeps each reduction's."""

    rank, size = 0, 1

    def __init__(self):
        self.calls = []

    def all_reduce(self, words, op):
        self.calls.append((op, words.copy()))
        return words.copy()


ROWS, SEQ = 4, 32
r2t_host = np.arange(ROWS * SEQ, dtype=np.int32).reshape(ROWS, SEQ)
r2t_host[0] = 0
r2t = cupy.asarray(r2t_host)
NAMES = ("full", "draft")


def manager(comm, **kw):
    return CanaryManager([KVGroup(name="full", req_to_token=r2t, num_slots=ROWS * SEQ, verify_capacity=64),
                          KVGroup(name="draft", req_to_token=r2t, num_slots=ROWS * SEQ, verify_capacity=64,
                                  kv_token_id_vs_position_offset=1)],
                         max_batch_size=4, device=0, communicator=comm, ring_capacity=4, **kw)


# Without a communicator: no agreement words, no launch (the block's layout as before)
plain = manager(None)
assert plain._steps.agree is None and plain._transfer.mailbox.block.index_words == 6
plain.close()

comm = Recorder()
m = manager(comm)
m.warmup()
block = m._transfer.mailbox.block
assert block.index_words == 10 and block.agree_words == [6, 8] and block.heads[0] == 10
if sys.argv[1:] != ["kernel"]:
    m._transfer.report_launch, m._report_in_graph = None, False  # the copies' path
assert (m._transfer.report_launch is not None) == (sys.argv[1:] == ["kernel"])
m.add_request("a", list(range(5, 5 + SEQ - 2)))
rng = np.random.default_rng(0)
# static step arrays (the same objects every step, refilled), so that the eager steps are captured and replayed
rpi, prefix, ext = (cupy.asarray(np.zeros(1, np.int64)) for _ in range(3))
loc, tok, pos = cupy.asarray(np.zeros(3, np.int64)), cupy.asarray(np.zeros(3, np.int32)), \
    cupy.asarray(np.zeros(3, np.int64))
draft_loc = cupy.asarray(np.zeros(3, np.int32))
row = m.requests.live["a"].row
rpi.set(np.array([row]))
want = []
for step in range(8):
    p = 3 * step
    prefix.set(np.array([p])), ext.set(np.array([3]))
    m.before_forward(req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=ext, request_ids=["a"])
    words = {}
    for g in m.groups:  # what the plan kernel would have written: some MISSING_SLOT entries, a count
        vp = g.verify_plan
        cap = vp.verify_slot_indices.shape[0]
        slots = rng.integers(0, ROWS * SEQ, cap)
        slots[rng.random(cap) < 0.3] = MISSING_SLOT
        vp.verify_slot_indices.set(slots)
        vp.verify_expected_tokens.set(rng.integers(-5, 1 << 20, cap))
        vp.verify_expected_positions.set(rng.integers(0, SEQ, cap))
        vp.verify_num_valid.set(np.array([[0, cap, cap + 3, 5][step % 4]], np.int32))
        words[g.name] = plan_digest(SimpleNamespace(**{f: getattr(vp, f).get() for f in (
            "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_num_valid")}))
    slots = np.array([r2t_host[row, p], -1 if step % 3 == 1 else r2t_host[row, p + 1], r2t_host[row, p + 2]])
    loc.set(slots), tok.set(rng.integers(-9, 1 << 30, 3).astype(np.int32)), pos.set(np.arange(p, p + 3))
    by_group = None
    if step == 5:  # the draft group's own slots (the host formula reads those for it)
        draft_loc.set(slots[::-1].astype(np.int32))
        by_group = {"draft": draft_loc}
    groups = ["full"] if step == 6 else None  # the draft group planned but not written: its words are 0
    m.after_kv_store(out_cache_loc=loc, input_ids=tok, positions=pos, groups=groups, out_cache_loc_by_group=by_group)
    for name in NAMES:
        written = groups is None or name in groups
        lw = (by_group or {}).get(name, loc).get()
        want.append((words[name], entries_digest(lw, tok.get(), pos.get())) if written else (0, 0))
m.flush()
s = m.stats()
assert s["decoded_steps"] == 8 and s["agreement"]["agreed_steps"] == 8, s
g, w = len(NAMES), len(FIELDS)
got = []
for op, words in comm.calls:
    assert op == "max"  # one rank agrees with itself: never a gather
    for i in range(g):
        base = g + i * w
        got.append((int(words[base + FIELDS.index("plan")]), int(words[base + FIELDS.index("entries")])))
assert got == want, (got, want)
assert all(e != 0 for _, e in want[:12]) and want[13] == (0, 0)  # step 6's draft
assert s["graph_replays"] > 0, s  # the words were added inside replayed step graphs too
assert [v for v in m.open_violations] == []
m.close()
print("OK")
