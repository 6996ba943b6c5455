"""The manager's CUDA transfer path on tests/helpers/fakecuda.py (host memory posing as a device), in its own
process: the fake CuPy must not meet the test session's imports. Run by ``test_transfer_fake.py``.

``python transfer_fake_child.py kernel|copy``: the step's report written by the report kernel into the pinned
mailbox (the CuPy backend's path; the stand-in runs kernels/report.cu's semantics on host memory), or by copies,
a memset and an event (the other backends' path).

What runs for real here: every copy and memset of the step (the fake runtime moves the bytes), the report
block's layout, the reset of the write indexes behind the report, the staging of pool rows, valid lengths and
expected tokens, the eager steps replayed as graphs. The planner and canary kernels launch nothing (but count
their launches), so the test writes a violation row into a group's ring itself, as the verify kernel would.
Prints ``OK``; a failure is an assertion error.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT))

import fakecuda  # noqa: E402

fakecuda.install()
fakecuda.EMULATE_SCATTER = True  # the pool's contents are checked below

import cupy  # noqa: E402 - the fake

from canary import CanaryManager, FailReason, KVGroup  # noqa: E402
from canary.interop.devices import allocator  # noqa: E402
from canary.contract.ring import KernelTag, append_rows, encode_tag  # noqa: E402

ROWS, SEQ = 4, 16
r2t_host = np.arange(ROWS * SEQ, dtype=np.int32).reshape(ROWS, SEQ)
r2t_host[0] = 0
r2t = cupy.asarray(r2t_host)
got = []
m = CanaryManager([KVGroup(name="full", req_to_token=r2t, num_slots=ROWS * SEQ, verify_capacity=64),
                   KVGroup(name="draft", req_to_token=r2t, num_slots=ROWS * SEQ, verify_capacity=64,
                           kv_token_id_vs_position_offset=1)],
                  max_batch_size=4, device=0, on_violation=got.append, ring_capacity=4)
m.warmup()
assert all(g.verify_launch is not None for g in m.groups), "the groups' verifies were not prepared"
KERNEL = sys.argv[1:] == ["kernel"]
assert (m._transfer.report_launch is not None) is True
if not KERNEL:
    m._transfer.report_launch, m._report_in_graph = None, False  # the copies' path
scattered = []
scatter = m._transfer.scatter


def recording_scatter(k, t, stream):
    upd, u = m._transfer.upd.get(), m._transfer.u_cap  # the staging the scatter reads, copied by then
    scattered.append((upd[:k].tolist(), upd[3 * u + 1:3 * u + 1 + t].tolist(), upd[2 * u:2 * u + k + 1].tolist(),
                      upd[u:u + k].tolist()))
    scatter(k, t, stream)


m._transfer.scatter = recording_scatter
m.add_request("a", [5, 6, 7])
m.add_request("b", [9])
a = cupy.asarray
rpi = a(np.array([2, 1], dtype=np.int64))
before = dict(req_pool_indices=rpi, prefix_lens=a(np.array([0, 0], dtype=np.int64)),
              extend_seq_lens=a(np.array([3, 1], dtype=np.int64)))
after = dict(out_cache_loc=a(np.array([32, 33, 34, 16], dtype=np.int64)),
             input_ids=a(np.array([5, 6, 7, 9], dtype=np.int64)), positions=a(np.array([0, 1, 2, 0], dtype=np.int64)))
fakecuda.COUNTS.clear()
m.before_forward(request_ids=["a", "b"], **before)
row_a, row_b = m.requests.live["a"].row, m.requests.live["b"].row
# Both prompts in one scatter: pool rows, flat tokens, offsets, first columns.
assert scattered == [([row_a, row_b], [5, 6, 7, 9], [0, 3, 4], [0, 0])], scattered
qv = m._qv.get()
assert qv[:2].tolist() == [row_a, row_b] and qv[4:6].tolist() == [3, 1], qv  # pool rows, then valid lengths

# What the draft group's verify kernel would do on finding slot 17 (row 1, position 1) corrupt.
draft = m.groups[1]
state = draft.state
row = np.array([[encode_tag(KernelTag.VERIFY, draft.verify_tag), 17, 1, 1, 2, 0, 0, int(FailReason.VERIFY_TOKEN)]])
append_rows(state.ring._a, state.ring_write_index._a, row)
m.after_kv_store(**after)
counts = dict(fakecuda.COUNTS)
# One step: the pool rows, valid lengths and the scatter's tokens host-to-device in one copy (one staging area);
# then either the report kernel, or the report block and req_pool_indices device-to-host and one memset of the
# write indexes.
assert m._transfer.merged
assert counts["cuda.cudaMemcpyAsync D2D"] == 1, counts  # the step's req_pool_indices, at before_forward
if KERNEL:
    assert counts["cuda.cudaMemcpyAsync"] == 1 and "cuda.cudaMemsetAsync" not in counts, counts
    assert counts["kernel launch"] == 2 * 3 + 2, counts  # plan, verify, write per group, the scatter, the report
else:
    assert counts["cuda.cudaMemcpyAsync"] == 3 and counts["cuda.cudaMemsetAsync"] == 1, counts
    assert counts["kernel launch"] == 2 * 3 + 1, counts  # plan, verify, write per group, and the scatter
assert state.ring_write_index.get()[0] == 0, "the write index was not cleared behind the snapshot"
assert got == [], "reported before the next step"
m.flush()
found = [v for vs in got for v in vs]
assert [(v.group, v.slot, v.position, v.reasons, v.requests) for v in found] == \
    [("draft", 17, 1, FailReason.VERIFY_TOKEN, (("b", 1),))], [v.line() for v in found]
s = m.stats()
assert s["decoded_steps"] == 1, s

# A clean second step reports nothing new; its counters come through the same block.
m.accept_tokens("a", [8])
m.before_forward(request_ids=["a", "b"], **before)
assert m._qv.get()[4:6].tolist() == [4, 1]
m.after_kv_store(**after)
m.flush()
assert len(got) == 1, [v.line() for vs in got for v in vs]
assert m.stats()["decoded_steps"] == 2
# Steady state: a staging buffer reused after its step's report was read needs no wait on its event.
fakecuda.COUNTS.clear()
for _ in range(4):
    m.before_forward(request_ids=["a", "b"], **before)
    m.after_kv_store(**after)
    m.poll()
assert "cuda.cudaEventSynchronize" not in fakecuda.COUNTS, dict(fakecuda.COUNTS)
assert m.stats()["decoded_steps"] == 6 and len(got) == 1
# The same step arrays every step: from the third step on, each call is one graph replay (the report inside
# the after_kv_store graph on the kernel path), and a violation still comes through.
assert m._eager.replays >= 2 * 2, m._eager.replays
fakecuda.COUNTS.clear()
append_rows(state.ring._a, state.ring_write_index._a, row)
m.before_forward(request_ids=["a", "b"], **before)
m.after_kv_store(**after)
m.flush()
counts = dict(fakecuda.COUNTS)
assert counts["graph launch"] == 2 and "kernel launch" not in counts, counts
assert ("cuda.cudaMemcpyAsync" in counts) is (not KERNEL), counts
# The same corrupt slot again: a repeat of the open record, not a new report
assert len(got) == 1 and got[0][0].count == 2 and got[0][0].steps[-1] == 6, [v.line() for vs in got for v in vs]
# A graph replay only for the call it captured: after_kv_store for fewer groups than the captured one writes
# those groups only (the draft group's write counter stays; its verify ran in before_forward).
m.flush()
draft_before = m._last_counters["draft"]
m.before_forward(request_ids=["a", "b"], **before)
m.after_kv_store(groups=["full"], **after)
m.flush()
assert m._last_counters["draft"][0] == draft_before[0] and m._last_counters["draft"][1] > draft_before[1], \
    (draft_before, m._last_counters["draft"])
# A token accepted, then a before_forward whose graph launch fails: the staged token still reaches the pool (the
# stand-in runs the scatter on host memory), and the next call stages again.
replays = m._eager.replays
for t in range(3):  # a token accepted every step: from the second on, its scatter inside the before-graph
    m.accept_tokens("a", [40 + t])
    m.before_forward(request_ids=["a", "b"], **before)
    m.after_kv_store(**after)
assert m._eager.replays >= replays + 2, (replays, m._eager.replays)
row_a = m.requests.live["a"].row
col = int(m.requests.counts[row_a])
m.accept_tokens("a", [55])
launch = m._eager.rt.graph_launch


def failing_launch(*args):
    raise RuntimeError("kv-canary: cudaGraphLaunch: expected cudaSuccess, got a test's failure")


def expect_failing_before(ids, step, relaunch_fails=False):
    """before_forward with its graph launch failing (and, if asked, the staged launch's relaunch too): it raises."""
    relaunch = m._transfer.launch_deferred
    m._eager.rt.graph_launch = failing_launch
    if relaunch_fails:
        m._transfer.launch_deferred = failing_launch
    try:
        m.before_forward(request_ids=ids, **step)
        raise AssertionError("the failing launch did not raise")
    except RuntimeError as exc:
        assert "test's failure" in str(exc)
    finally:
        m._eager.rt.graph_launch = launch
        m._transfer.launch_deferred = relaunch


expect_failing_before(["a", "b"], before)
assert m.pool_array._a[row_a, col] == 55, m.pool_array._a[row_a, :col + 2]
assert m.pool_array._a[row_a, col - 3:col].tolist() == [40, 41, 42]  # the replayed scatters wrote theirs
m.before_forward(request_ids=["a", "b"], **before)
m.after_kv_store(**after)
m.flush()
assert m.pool_array._a[row_a, col] == 55 and m.requests.counts[row_a] == col + 1

# accept_tokens_batch for exactly the step's requests, in its order: the append scatter (rows and columns read from
# the plan's own staging, one copy of rows, valid lengths and tokens), inside the before-graph from the second
# step on; the tokens land where accept_tokens puts them. Then the same ids in another order, and a batch with a
# request's own accept_tokens mixed in: the general scatter, the same pool.
m.finish_request("a")
m.finish_request("b")
m.add_request("c", [1])
m.add_request("d", [2])
cols = {rid: int(m.requests.counts[m.requests.live[rid].row]) for rid in ("c", "d")}
general = m._transfer.scatter
calls = []
m._transfer.scatter = lambda k, t, stream: (calls.append(("general", k, t)), general(k, t, stream))
replays, captures = m._eager.replays, m._eager.captures
copies, seen = [], []
for t in range(10):
    m.accept_tokens_batch(["c", "d"], np.array([70 + t, 80 + t]))
    fakecuda.COUNTS.clear()
    m.before_forward(request_ids=["c", "d"], **before)
    m.after_kv_store(**after)
    copies.append(fakecuda.COUNTS["cuda.cudaMemcpyAsync"] - (0 if KERNEL else 2))  # less the report's copies
    seen.append(len(calls))
    assert m._qv.get()[4:6].tolist() == [cols["c"] + t + 1, cols["d"] + t + 1]  # the plan's valid lengths
# A new batch's first step stages through the general scatter (accept_batch looked its rows up first); from then on
# the host ints are copied into the device area (one copy, launched directly) and canary_append_tokens reads them
# there and advances the valid lengths on the device: no scatter, and one before-graph for the batch with its
# append, not one per staging buffer: captured at its second sighting, then replayed. The first step's general
# scatter is launched ahead of the graph of these very arrays (captured above): a replay too, as is every
# after_kv_store.
assert [c[0] for c in calls] == ["general"] * len(calls) and seen[-1] == seen[0], (calls, seen)
assert copies[1:] == [1] * 9, copies
assert m._eager.captures == captures + 1 and m._eager.replays == replays + 1 + 7 + 10, (captures, replays, m.stats())
# Without the device append (a Numba-backend manager): the append scatter, which reads its rows and columns from
# the plan's staging, one copy of rows, lengths and tokens a step, inside the before-graph once captured.
device_append, m._transfer.device_append = m._transfer.device_append, None
appended = m._append_scatter(allocator(0), m._transfer.upd)  # what such a manager builds
m._transfer.append = lambda k, t, stream: (calls.append(("append", k, t)), appended(k, t, stream))
m.add_request("g", [5])
m.add_request("h", [6])
copies = []
for t in range(8):
    m.accept_tokens_batch(["g", "h"], np.array([170 + t, 180 + t]))
    fakecuda.COUNTS.clear()
    m.before_forward(request_ids=["g", "h"], **before)
    m.after_kv_store(**after)
    copies.append(fakecuda.COUNTS.get("cuda.cudaMemcpyAsync", 0) - (0 if KERNEL else 2))
m._transfer.device_append, m._transfer.append = device_append, None
m.flush()
for rid, prompt, first in (("g", 5, 170), ("h", 6, 180)):
    r = m.requests.live[rid].row
    assert m.pool_array._a[r, :9].tolist() == [prompt] + list(range(first, first + 8)), m.pool_array._a[r]
    m.finish_request(rid)
# Host ints read from pinned memory by the device append hold their buffer until the step's report lands; a host
# that runs ahead with no report read waits for its stream before reusing a buffer (no event marks that use).
m.add_request("i", [7])
m.add_request("j", [8])
for t in range(8):
    if t == 2:
        m._poll_ready = lambda: None
        fakecuda.COUNTS.clear()
    m.accept_tokens_batch(["i", "j"], np.array([200 + t, 210 + t]))
    m.before_forward(request_ids=["i", "j"], **before)
    m.after_kv_store(**after)
del m._poll_ready
assert fakecuda.COUNTS["cuda.cudaStreamSynchronize"] >= 1, dict(fakecuda.COUNTS)
m.flush()
for rid, prompt, first in (("i", 7, 200), ("j", 8, 210)):
    r = m.requests.live[rid].row
    assert m.pool_array._a[r, :9].tolist() == [prompt] + list(range(first, first + 8)), m.pool_array._a[r]
    m.finish_request(rid)
assert {c for c in calls if c[0] == "append"} == {("append", 2, 2)} and copies[1:4] == [1, 1, 1], (calls, copies)
assert copies[-1] == 0, copies  # the copy inside the replayed graph of its staging buffer
n_calls = len(calls)
m.accept_tokens_batch(["d", "c"], np.array([91, 90]))  # not the step's order: the general scatter
m.before_forward(request_ids=["c", "d"], **before)
m.after_kv_store(**after)
m.accept_tokens_batch(["c", "d"], np.array([92, 93]))
m.accept_tokens("c", [94])  # a second update: the general scatter
m.before_forward(request_ids=["c", "d"], **before)
m.after_kv_store(**after)
assert [c[0] for c in calls[n_calls:]] == ["general"] * (len(calls) - n_calls) and len(calls) > n_calls, calls
# A graph launch that fails after an append was staged: its scatter still runs
m.accept_tokens_batch(["c", "d"], np.array([95, 96]))
expect_failing_before(["c", "d"], before)
m._transfer.scatter = general
m.before_forward(request_ids=["c", "d"], **before)
m.after_kv_store(**after)
m.flush()
pool = m.pool_array._a
ra, rb = m.requests.live["c"].row, m.requests.live["d"].row
assert pool[ra, cols["c"]:cols["c"] + 14].tolist() == list(range(70, 80)) + [90, 92, 94, 95], pool[ra, cols["c"]:]
assert pool[rb, cols["d"]:cols["d"] + 13].tolist() == list(range(80, 90)) + [91, 93, 96], pool[rb, cols["d"]:]
assert m.requests.counts[ra] == cols["c"] + 14 and m.requests.counts[rb] == cols["d"] + 13

# Device token ids (accept_tokens_batch with a device array): appended on the device by canary_append_tokens,
# which advances the plan's valid lengths there, so a step of the same batch copies nothing host-to-device; in the
# before-graph from the second step on. Then a batch in another order: the tokens come to the host (the general
# scatter), and the pool is the same as with host tokens.
m.finish_request("c")
m.finish_request("d")
m.add_request("e", [3])
m.add_request("f", [4])
calls.clear()
m._transfer.scatter = lambda k, t, stream: (calls.append(("general", k, t)), general(k, t, stream))
dev = cupy.asarray(np.zeros(2, dtype=np.int64))  # the engine's static buffer of sampled tokens
start = {rid: int(m.requests.counts[m.requests.live[rid].row]) for rid in ("e", "f")}
copies = []
for t in range(3):
    dev[:] = cupy.asarray(np.array([100 + t, 110 + t]))
    m.accept_tokens_batch(["e", "f"], dev)
    fakecuda.COUNTS.clear()
    m.before_forward(request_ids=["e", "f"], **before)
    m.after_kv_store(**after)
    copies.append(fakecuda.COUNTS.get("cuda.cudaMemcpyAsync", 0) - (0 if KERNEL else 2))
    assert m._qv.get()[4:6].tolist() == [start["e"] + t + 1, start["f"] + t + 1]  # advanced on the device
assert copies == [2, 0, 0], copies  # the first step of a new batch: its prompts and tokens through the host
assert m._eager.replays >= 2, m._eager.replays
n_general = len(calls)  # the new batch's first step
# Another order (int32 ids): scattered by the general kernel straight from the device array, its rows and columns
# staged, never copied to the host (no sync).
host_reads = []
get = type(dev).get
type(dev).get = lambda self: (host_reads.append(self.shape), get(self))[1]
m.accept_tokens_batch(["f", "e"], cupy.asarray(np.array([121, 120], dtype=np.int32)))
m.before_forward(request_ids=["e", "f"], **before)
type(dev).get = get
m.after_kv_store(**after)
assert len(calls) == n_general and (2,) not in host_reads, (calls, host_reads)
# A step of another batch in between: the device's staging holds that batch's rows, so the next device accept
# copies this batch's rows and lengths (from before the accept) first, then appends on the device.
one_row = dict(req_pool_indices=a(np.array([2], dtype=np.int64)), prefix_lens=a(np.array([0], dtype=np.int64)),
               extend_seq_lens=a(np.array([0], dtype=np.int64)))
empty = a(np.zeros(0, dtype=np.int64))
m.before_forward(request_ids=["e"], **one_row)
m.after_kv_store(out_cache_loc=empty, input_ids=empty, positions=empty)
m.accept_tokens_batch(["e", "f"], cupy.asarray(np.array([122, 132], dtype=np.int64)))
fakecuda.COUNTS.clear()
m.before_forward(request_ids=["e", "f"], **before)
m.after_kv_store(**after)
assert fakecuda.COUNTS["cuda.cudaMemcpyAsync"] - (0 if KERNEL else 2) == 1, dict(fakecuda.COUNTS)
assert m._qv.get()[4:6].tolist() == [start["e"] + 5, start["f"] + 5]
assert len(calls) == n_general, calls
for bad, exc, words in [(cupy.asarray(np.zeros(3, np.int64)), ValueError, r"token_ids: expected one token per "
                         r"request \(\[2\]\), got shape \(3,\)"),
                        (cupy.asarray(np.zeros(2, np.float32)), TypeError, "token_ids: expected int64 or int32")]:
    try:
        m.accept_tokens_batch(["e", "f"], bad)
        raise AssertionError("accepted " + words)
    except exc as e:
        assert re.search("kv-canary: " + words, str(e)), str(e)
m.flush()
pool = m.pool_array._a
for rid, want in (("e", [100, 101, 102, 120, 122]), ("f", [110, 111, 112, 121, 132])):
    r = m.requests.live[rid].row
    assert pool[r, start[rid]:start[rid] + 5].tolist() == want, pool[r]
    assert m.requests.counts[r] == start[rid] + 5
# A batch padded to a graph size (a None id): the padding row's token is ignored, pool row 0 stays empty, and the
# decode loop stays zero-copy (no host read of the device ids).
ids3 = ["e", "f", None]
before3 = dict(req_pool_indices=a(np.array([2, 1, 0], dtype=np.int64)),
               prefix_lens=a(np.array([0, 0, 0], dtype=np.int64)),
               extend_seq_lens=a(np.array([0, 0, 0], dtype=np.int64)))
buf3 = cupy.asarray(np.zeros(3, dtype=np.int64))
start3 = {rid: int(m.requests.counts[m.requests.live[rid].row]) for rid in ("e", "f")}
host_reads.clear()
type(dev).get = lambda self: (host_reads.append(self.shape), get(self))[1]
for t in range(4):
    buf3[:] = cupy.asarray(np.array([140 + t, 150 + t, 7]))
    m.accept_tokens_batch(ids3, buf3)
    m.before_forward(request_ids=ids3, **before3)
    m.after_kv_store(out_cache_loc=empty, input_ids=empty, positions=empty)
type(dev).get = get
assert (3,) not in host_reads, host_reads
m.flush()
pool = m.pool_array._a
for rid, first in (("e", 140), ("f", 150)):
    r = m.requests.live[rid].row
    assert pool[r, start3[rid]:start3[rid] + 4].tolist() == [first, first + 1, first + 2, first + 3], pool[r]
    assert m.requests.counts[r] == start3[rid] + 4
assert not pool[0].any() and m.requests.counts[0] == 0
# Copy at the accept (canary/manager/accepted.py): the engine zeroes or refills its sampled-id buffer right after
# each accept, before the step, and two accepts before one step, or more than the ring holds (the oldest then read
# to the host), each keep their tokens; int32 ids too, on an explicit stream.
from canary.manager.accepted import ACCEPT_SLOTS  # noqa: E402

m.add_request("p", [5])  # fresh rows: room for the accepts below
m.add_request("q", [6])
start4 = {rid: int(m.requests.counts[m.requests.live[rid].row]) for rid in ("p", "q")}
want4 = {"p": [], "q": []}
d32 = cupy.asarray(np.zeros(2, dtype=np.int32))
for t, accepts in enumerate((1, 2, 1, ACCEPT_SLOTS + 2, 1)):
    for j in range(accepts):
        e_tok, f_tok = 300 + 10 * t + j, 500 + 10 * t + j
        buf = d32 if (t + j) % 2 else dev
        buf[:] = cupy.asarray(np.array([e_tok, f_tok]))
        m.accept_tokens_batch(["p", "q"], buf, stream=0 if j % 2 else None)
        buf[:] = 0  # the engine reuses its buffer at once
        want4["p"].append(e_tok)
        want4["q"].append(f_tok)
    dev[:] = -1
    d32[:] = -1
    m.before_forward(request_ids=["p", "q"], **before)
    m.after_kv_store(**after)
m.flush()
pool = m.pool_array._a
for rid in ("p", "q"):
    r = m.requests.live[rid].row
    n = len(want4[rid])
    assert pool[r, start4[rid]:start4[rid] + n].tolist() == want4[rid], (rid, pool[r, start4[rid]:], want4[rid])
    assert m.requests.counts[r] == start4[rid] + n
assert all(h.update is None for h in m._transfer.staging.accept.slots)  # every slot read and released
m.finish_request("p")
m.finish_request("q")
# The graph launch and then the relaunch of the staged append both fail (a persistent CUDA error): no step is left
# open, and the update is queued again, so the next step stages it afresh (no column skipped or written twice).
m.accept_tokens_batch(ids3, cupy.asarray(np.array([160, 170, 7])))
expect_failing_before(ids3, before3, relaunch_fails=True)
assert m._step is None and len(m.requests.updates) == 1
m.before_forward(request_ids=ids3, **before3)
m.after_kv_store(out_cache_loc=empty, input_ids=empty, positions=empty)
m.flush()
for rid, want in (("e", 160), ("f", 170)):
    r = m.requests.live[rid].row
    assert pool[r, start3[rid] + 4] == want and m.requests.counts[r] == start3[rid] + 5, pool[r]
m._transfer.scatter = general
decoded = m.stats()["decoded_steps"]

# int32 req_pool_indices on a device manager (issue 26): the report's copy strides them into its 8-byte words (one
# 2-D device-to-device copy, in the before-graph once captured) and the decoder reads the low halves: a violation is
# named exactly as with int64 rows, by a direct step and by a replayed one; stale high halves change nothing.
m.flush()
m._steps.rpi_snap[:] = cupy.asarray(np.full(m.max_batch_size, 7 << 40, dtype=np.int64))  # high halves: garbage
before32 = {k: a(v.get().astype(np.int32)) for k, v in before.items()}
f_row = int(before["req_pool_indices"].get()[1])
for t in range(5):
    if t in (0, 4):  # the first step launches directly, the last one replays its graph
        viol = np.array([[encode_tag(KernelTag.VERIFY, draft.verify_tag), f_row * SEQ + 5 + t, 5 + t, 1, 2, 0, 0,
                          int(FailReason.VERIFY_TOKEN)]])
        append_rows(state.ring._a, state.ring_write_index._a, viol)
    fakecuda.COUNTS.clear()
    m.before_forward(request_ids=["e", "f"], **before32)
    m.after_kv_store(**after)
    assert fakecuda.COUNTS.get("cuda.cudaMemcpy2DAsync D2D", 0) == (1 if t < 2 else 0), dict(fakecuda.COUNTS)
m.flush()
named = {v.slot: v.requests for vs in got for v in vs if v.slot in (f_row * SEQ + 5, f_row * SEQ + 9)}
assert named == {f_row * SEQ + 5: (("f", 5),), f_row * SEQ + 9: (("f", 9),)}, named
assert m.stats()["graph_replays"] > 0
decoded = m.stats()["decoded_steps"]

# Far ahead of the GPU: more steps than report slots with no report read in between (as if none had landed):
# the oldest is copied out of its slot when the slots run out, and nothing is lost.
m._poll_ready = lambda: None
for _ in range(m._transfer.slots + 3):
    m.before_forward(request_ids=["e", "f"], **before)
    m.after_kv_store(**after)
del m._poll_ready
assert len(m._pending) == m._transfer.slots + 3
m.flush()
assert m.stats()["decoded_steps"] == decoded + m._transfer.slots + 3, m.stats()["decoded_steps"]
# An explicit stream= (issue 26): the step arrays' library (the stand-in CuPy, whose current stream is the legacy
# default stream) ordered before it once per call, one event and one wait, and the calls replayed as graphs
side = cupy.cuda.Stream(non_blocking=True)
m.flush()
replays, shakes = m.stats()["graph_replays"], m.stats()["stream_handshakes"]
fakecuda.COUNTS.clear()
for _ in range(4):
    m.before_forward(request_ids=["e", "f"], stream=side, **before)
    m.after_kv_store(stream=side, **after)
counts = dict(fakecuda.COUNTS)
assert counts["cuda.cudaStreamWaitEvent"] >= 2 * 4 and m.stats()["stream_handshakes"] == shakes + 8, counts
assert m.stats()["graph_replays"] >= replays + 4, (replays, m.stats())
m.flush()
fakecuda.COUNTS.clear()
m.before_forward(request_ids=["e", "f"], stream=cupy.cuda.get_current_stream(), **before)  # the current one:
m.after_kv_store(stream=cupy.cuda.get_current_stream(), **after)  # nothing to order
assert m.stats()["stream_handshakes"] == shakes + 8
# close() decodes the step still queued (a last step's report), then frees the pinned staging and mailbox; a later
# call raises instead of writing into the freed pinned memory.
m.before_forward(request_ids=["e", "f"], **before)
m.after_kv_store(**after)
decoded = m.stats()["decoded_steps"]
m.close()
assert m.stats()["decoded_steps"] == decoded + 1 and not m._pending
m.close()  # a second close does nothing
for call in (lambda: m.before_forward(request_ids=["e", "f"], **before), lambda: m.after_kv_store(**after),
             lambda: m.accept_tokens_batch(["e", "f"], np.array([1, 2])), m.flush, lambda: m.begin_step(["e", "f"])):
    try:
        call()
    except RuntimeError as e:
        assert "expected an open manager, got one closed by close()" in str(e), str(e)
    else:
        raise AssertionError("a call after close() was accepted")
print("OK")
