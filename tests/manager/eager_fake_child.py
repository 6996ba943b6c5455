"""Eager graphs change nothing the device holds: two managers, one replaying its calls as CUDA graphs
(``eager_graphs=True``) and one launching directly, driven by the same random engine schedule on
tests/helpers/fakecuda.py (the scatter, the device append and every copy emulated on host memory), hold the same
expected-token pool, the same valid lengths and the same staged rows after every step, the pool and lengths
a host manager (the reference backend) holds, and the eager one did replay. Run by ``test_eager_fake.py``: ``python eager_fake_child.py SEED [SEED ...]``; prints ``OK``.

A schedule: requests join (prompts of 1-6 tokens) and leave, batches of changing size padded to a power of two
(static step arrays per size, int64 or int32 rows), tokens accepted for the batch in its order, in another order,
with padding, as host ints, as a device array (int64 or int32, the engine's buffer then refilled), or one request
at a time; some steps accept nothing.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT))

import fakecuda  # noqa: E402

fakecuda.install()
fakecuda.EMULATE_SCATTER = True

import cupy  # noqa: E402 - the fake

from canary import CanaryManager, KVGroup  # noqa: E402

ROWS, SEQ, CAP = 9, 48, 8


def manager(eager: bool | None) -> CanaryManager:
    """``None``: the host manager (NumPy arrays, the reference backend), the semantics both others must hold."""
    xp = np if eager is None else cupy
    r2t = xp.asarray(np.arange(ROWS * SEQ, dtype=np.int32).reshape(ROWS, SEQ))
    m = CanaryManager(KVGroup(name="full", req_to_token=r2t, num_slots=ROWS * SEQ, verify_capacity=ROWS * SEQ),
                      max_batch_size=CAP, device="cpu" if eager is None else 0, on_violation=lambda v: None,
                      eager_graphs=bool(eager))
    m.warmup()
    return m


def run(seed: int) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    ms = [manager(True), manager(False)]
    host = manager(None)
    a = cupy.asarray
    steps = {(b, w): tuple(a(np.zeros(b, w)) for _ in range(3)) for b in (1, 2, 4, 8) for w in (np.int64, np.int32)}
    empty = a(np.zeros(0, np.int64))
    live: dict[int, int] = {}  # request -> its engine row
    free = list(range(1, ROWS))
    nxt, room = 0, {}
    sampled = {w: a(np.zeros(CAP, w)) for w in (np.int64, np.int32)}  # the engine's buffers of sampled ids
    for step in range(160):
        if free and (len(live) < 2 or rng.random() < 0.3):
            rid = nxt
            nxt += 1
            live[rid] = free.pop(rng.integers(len(free)))
            prompt = rng.integers(1, 1000, size=int(rng.integers(1, 7))).tolist()
            room[rid] = SEQ - len(prompt)
            for m in ms + [host]:
                m.add_request(rid, prompt)
        if len(live) > 1 and rng.random() < 0.15:
            rid = list(live)[int(rng.integers(len(live)))]
            free.append(live.pop(rid))
            for m in ms + [host]:
                m.finish_request(rid)
        batch = sorted(live) if rng.random() < 0.8 else list(rng.permutation(sorted(live)))
        batch = [int(r) for r in batch][:CAP]
        b = 1 << max(0, len(batch) - 1).bit_length()
        ids = batch + [None] * (b - len(batch))
        # accepts for this step, before it
        how = rng.choice(["batch", "other-order", "device", "device32", "each", "none"],
                         p=[0.35, 0.1, 0.2, 0.1, 0.1, 0.15])
        takers = [r for r in batch if room[r] > 2]
        if how in ("batch", "other-order", "device", "device32") and takers == batch and batch:
            order = ids if how != "other-order" else list(reversed(batch)) + [None] * (b - len(batch))
            toks = rng.integers(1, 1000, size=b)
            for r in batch:
                room[r] -= 1
            if how.startswith("device"):
                buf = sampled[np.int32 if how == "device32" else np.int64]
                buf[:b] = a(toks.astype(buf.dtype))
                arg = buf[:b]
            else:
                arg = toks
            for m in ms:
                m.accept_tokens_batch(order, arg)
            host.accept_tokens_batch(order, toks)
            if how.startswith("device"):
                buf[:b] = a(np.zeros(b, buf.dtype))  # the engine reuses its buffer at once
        elif how == "each":
            for r in takers[:2]:
                k = int(rng.integers(1, 3))
                room[r] -= k
                toks = rng.integers(1, 1000, size=k).tolist()
                for m in ms + [host]:
                    m.accept_tokens(r, toks)
        w = np.int32 if rng.random() < 0.3 else np.int64
        rpi, pre, ext = steps[(b, w)]
        rpi[:] = a(np.array([live[r] for r in batch] + [0] * (b - len(batch)), w))
        pre[:] = a(np.zeros(b, w))
        ext[:] = a(np.zeros(b, w))
        for m in ms:
            m.before_forward(request_ids=ids, req_pool_indices=rpi, prefix_lens=pre, extend_seq_lens=ext)
            m.after_kv_store(out_cache_loc=empty, input_ids=empty, positions=empty)
        hrows = np.array([live[r] for r in batch] + [0] * (b - len(batch)), w)
        host.before_forward(request_ids=ids, req_pool_indices=hrows, prefix_lens=np.zeros(b, w),
                            extend_seq_lens=np.zeros(b, w))
        host.after_kv_store(out_cache_loc=np.zeros(0, np.int64), input_ids=np.zeros(0, np.int64),
                            positions=np.zeros(0, np.int64))
        e, d = ms
        assert np.array_equal(d.pool_array._a, host.pool_array), (seed, step, how, np.argwhere(
            d.pool_array._a != host.pool_array)[:4].tolist())
        assert np.array_equal(d.requests.counts, host.requests.counts), (seed, step)
        assert np.array_equal(e.pool_array._a, d.pool_array._a), (seed, step, np.argwhere(
            e.pool_array._a != d.pool_array._a)[:4].tolist())
        assert np.array_equal(e.requests.counts, d.requests.counts), (seed, step)
        got, want = e._qv.get(), d._qv.get()
        assert np.array_equal(got[:b], want[:b]) and np.array_equal(got[CAP:CAP + b], want[CAP:CAP + b]), \
            (seed, step, how, got[:b], want[:b], got[CAP:CAP + b], want[CAP:CAP + b])
    for m in ms:
        m.flush()
    replays = ms[0].stats()["graph_replays"]
    assert ms[1].stats()["graph_replays"] == 0
    for m in ms + [host]:
        m.close()
    return replays, nxt


if __name__ == "__main__":
    total = 0
    for s in sys.argv[1:]:
        replays, _ = run(int(s))
        assert replays > 20, (s, replays)  # the schedule did exercise the graphs
        total += replays
    print(f"replays {total}")
    print("OK")
