"""One CUDA-graph capture of CanaryManager's per-step calls, in its own process (a failed capture poisons it).

``python manager_capture_child.py LIBRARY`` (torch: ``torch.cuda.graph`` over torch tensors, the manager
allocating with ``library="torch"``; cupy: ``Stream.begin_capture`` over CuPy arrays). Two requests prefill
eagerly; then ``before_forward`` and ``after_kv_store`` of a decode step are captured over static step buffers;
each later step refills the buffers in place, calls ``begin_step`` before the replay and ``end_step`` after it.
Clean steps must report nothing and advance the counters; a flipped KV bit must be reported, naming the request.
Prints ``OK``; any failure is an assertion error (non-zero exit).

``python manager_capture_child.py LIBRARY layers``: the same with 3 layers of K bytes and the layer rotation on
(``KVGroup(layer_sources=...)``); the flipped bit is in the last layer, which only the rotation reads: it must be
reported once within 3 replays, naming the layer (the device cursor rotates across graph replays).
"""
from __future__ import annotations

import sys

import numpy as np

LIB = sys.argv[1]
LAYERS = 3 if sys.argv[2:] == ["layers"] else 0

import cupy  # noqa: E402
import torch  # noqa: E402

from canary import CanaryManager, FailReason, KVGroup  # noqa: E402

ROWS, SEQ, SLOTS, BS = 4, 64, 4 * 64, 2


def dev(host):
    return torch.from_numpy(np.ascontiguousarray(host)).cuda() if LIB == "torch" else cupy.asarray(host)


def refill(d, host):
    if LIB == "torch":
        d.copy_(torch.from_numpy(np.ascontiguousarray(host)))
    else:
        d.set(np.ascontiguousarray(host))


r2t_host = np.arange(ROWS * SEQ, dtype=np.int32).reshape(ROWS, SEQ)
r2t_host[0] = 0
r2t = dev(r2t_host)
k_host = np.zeros((max(LAYERS, 1), SLOTS, 32), dtype=np.uint8)
k = dev(k_host)
got = []
extra = dict(layer_sources=[[(k[i], 1, 32)] for i in range(LAYERS)]) if LAYERS else {}
mgr = CanaryManager([KVGroup(name="full", req_to_token=r2t, num_slots=SLOTS, verify_capacity=256,
                             real_kv_sources=[(k[0], 1, 32)], **extra)],
                    max_batch_size=BS, device=0, library=LIB, on_violation=got.append)
mgr.warmup()
stream = torch.cuda.Stream() if LIB == "torch" else cupy.cuda.Stream(non_blocking=True)
tokens = {"a": [5, 6, 7], "b": [9, 10, 11, 12]}
rows = {"a": 1, "b": 2}
for rid, toks in tokens.items():
    mgr.add_request(rid, toks)


def store(rid, lo, hi):
    for p in range(lo, hi):
        k_host[:, r2t_host[rows[rid], p]] = (np.arange(32) * 7 + p * 13 + rows[rid]) % 251
        k_host[:, r2t_host[rows[rid], p]] ^= np.arange(k_host.shape[0], dtype=np.uint8)[:, None]
    refill(k, k_host)


def i64(v):
    return dev(np.asarray(v, dtype=np.int64))


def ctx():
    return torch.cuda.stream(stream) if LIB == "torch" else stream


# Eager prefill of both requests.
with ctx():
    for rid in ("a", "b"):
        n = len(tokens[rid])
        store(rid, 0, n)
        mgr.before_forward(req_pool_indices=i64([rows[rid]]), prefix_lens=i64([0]), extend_seq_lens=i64([n]),
                           request_ids=[rid], stream=stream)
        mgr.after_kv_store(out_cache_loc=i64(r2t_host[rows[rid], :n]), input_ids=i64(tokens[rid]),
                           positions=i64(np.arange(n)), stream=stream)
        tokens[rid].append(100 + n)
        mgr.accept_tokens(rid, [100 + n])

# Static decode buffers.
lens = {rid: len(t) - 1 for rid, t in tokens.items()}  # the next position to write = cached length


def host_step():
    pre = np.array([lens["a"], lens["b"]], dtype=np.int64)
    loc = np.array([r2t_host[1, lens["a"]], r2t_host[2, lens["b"]]], dtype=np.int64)
    ids = np.array([tokens["a"][lens["a"]], tokens["b"][lens["b"]]], dtype=np.int64)
    return pre, loc, ids, pre.copy()


rpi = i64([1, 2])
pre, loc, ids, pos = (i64(x) for x in host_step())
ext = i64([1, 1])


def calls():
    mgr.before_forward(req_pool_indices=rpi, prefix_lens=pre, extend_seq_lens=ext, request_ids=["a", "b"],
                       stream=stream)
    mgr.after_kv_store(out_cache_loc=loc, input_ids=ids, positions=pos, stream=stream)


if LIB == "torch":
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        calls()
    replay = graph.replay
else:
    stream.begin_capture()
    try:
        calls()
    finally:
        g = stream.end_capture()
    replay = lambda: g.launch(stream)  # noqa: E731


def decode_step():
    # The engine's KV stores and buffer refills run on its stream, as the replays do: on another stream (CuPy's
    # legacy default stream does not wait for a non-blocking stream) they would race the last replay's reads.
    with ctx():
        for rid in ("a", "b"):
            store(rid, lens[rid], lens[rid] + 1)
        for d, h in zip((pre, loc, ids, pos), host_step()):
            refill(d, h)
        mgr.begin_step(["a", "b"], stream=stream)
        replay()
        mgr.end_step(stream=stream)
    for rid in ("a", "b"):
        lens[rid] += 1
        tokens[rid].append(200 + lens[rid])
        mgr.accept_tokens(rid, [tokens[rid][-1]])


for _ in range(4):
    decode_step()
mgr.flush()
s = mgr.stats()
assert got == [], [v.line() for vs in got for v in vs]
assert s["decoded_steps"] == 2 + 4, s
assert s["verified_entries"]["full"] > 0 and s["written_entries"]["full"] == 3 + 4 + 2 * 4, s
k_host[-1, r2t_host[2, 1], 0] ^= 1  # one flipped bit in the (last layer's) K bytes of b's position 1
with ctx():
    refill(k, k_host)
for _ in range(LAYERS or 2):
    decode_step()
mgr.flush()
found = [v for vs in got for v in vs]
want = (1, FailReason.REAL_KV, ("b",), 1, LAYERS - 1) if LAYERS else (1, FailReason.REAL_KV, ("b",), 2, None)
assert [(v.position, v.reasons, v.request_ids, v.count, v.layer) for v in found] == [want], \
    [v.line() for v in found]
mgr.close()
print("OK")
