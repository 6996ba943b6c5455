"""The cached-prefix sweep (docs/integration.md 5b) on the reference backend: detection within the documented
number of steps, rotation coverage, eviction, budget 0, no false reports, argument errors; the Numba-simulator
suite (sweep_sim_suite.py, collected under -m sim) and a CuPy run (GPU)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers.manager_engine import ToyEngine

from canary import CanaryManager, FailReason, KVGroup
from canary.manager.sweep import POSITION, PREV, SLOT, TOKEN, GroupSweep

PROMPTS = {"c0": [31, 32, 33, 34, 35], "c1": [41, 42, 43, 44, 45, 46, 47], "c2": [51, 52, 53, 54]}


def cached_engine(budget=3, prompts=PROMPTS, **kw) -> tuple[ToyEngine, list]:
    """A toy engine whose finished requests' KV stays cached (their slots are never reused) and is registered for
    the sweep under the request id, plus one live request "live" that keeps the steps going."""
    got: list = []
    e = ToyEngine(on_violation=got.append, sweep_budget=budget, **kw)
    for rid, prompt in prompts.items():
        e.add(rid, prompt)
        e.forward([(rid, len(prompt))])
        row = e.reqs[rid]["row"]
        e.finish(rid, free_row=False)  # the row is never handed out again: its slots stay cached
        e.manager.cache_prefix(rid, e.r2t_host[row, :len(prompt)].copy(), prompt)
    e.add("live", [7, 8, 9])
    e.decode_step(["live"])
    e.manager.flush()
    assert got == []
    return e, got


def tick(e: ToyEngine) -> None:
    """One decode step of "live"; restarted in the same row (same slots) before its row fills up."""
    if e.reqs["live"]["kv_len"] >= 28:
        e.finish("live")
        e.add("live", [7, 8, 9])
    e.decode_step(["live"])


def cached_slots(e: ToyEngine, rid: str) -> list[int]:
    sweep = e.manager._sweep.sweeps["full"]
    return sweep.runs[rid].block[SLOT].tolist()


def found(got) -> list:
    return [v for vs in got for v in vs]


def test_a_flipped_kv_byte_in_a_cached_prefix_is_found_within_the_documented_steps():
    e, got = cached_engine(budget=3)
    total = sum(len(p) for p in PROMPTS.values())
    bound = math.ceil(total / 3)  # the sweep verifies it within `bound` steps; the report comes one step later
    for rid in PROMPTS:
        for pos, slot in enumerate(cached_slots(e, rid)):
            e.flip("full", slot)
            steps = 0
            while not got:
                tick(e)
                steps += 1
                assert steps <= bound + 1, (rid, pos, steps, bound)
            (v,) = found(got)
            assert (v.kernel, v.slot, v.position, v.reasons) == ("sweep", slot, pos, FailReason.REAL_KV)
            assert v.prefixes == ((rid, pos),) and v.requests == ()
            assert f"prefixes={rid}@{pos} count=1" in v.line()
            e.flip("full", slot)  # repaired: the next corruption is a different slot
            got.clear()
    e.manager.flush()
    assert got == []


def test_a_corrupted_record_in_a_cached_prefix_is_found_and_names_the_prefix():
    e, got = cached_engine(budget=4)
    slot = cached_slots(e, "c1")[3]
    fields = e.manager.groups[0].records.views.fields  # host [num_slots, 4] int64 view of the canary buffer
    fields[slot, 0] += 1  # the stored token: VERIFY_TOKEN here, CHAIN at the next position
    for _ in range(math.ceil(16 / 4) + 1):
        tick(e)
    e.manager.flush()
    by_pos = {v.position: v for v in found(got)}
    assert set(by_pos) == {3, 4}
    assert by_pos[3].reasons == FailReason.VERIFY_TOKEN and by_pos[3].prefixes == (("c1", 3),)
    assert by_pos[4].reasons == FailReason.CHAIN and by_pos[4].kernel == "sweep"


def test_the_rotation_covers_every_registered_entry_with_its_chain_and_tokens():
    e, _ = cached_engine(budget=5)
    sweep = e.manager._sweep.sweeps["full"]
    expected = set()
    for rid, prompt in PROMPTS.items():
        slots = cached_slots(e, rid)
        for p, (s, t) in enumerate(zip(slots, prompt)):
            expected.add((s, t, p, slots[p - 1] if p else -1))
    seen, total = [], len(expected)
    for _ in range(math.ceil(total / 5)):
        tick(e)
        block = sweep.block
        n, enable = block[0:1].view(np.int32).tolist()
        assert enable == 1 and n == 5
        entries = block[1:].reshape(4, 5)[:, :n]
        seen += [tuple(int(x) for x in entries[[SLOT, TOKEN, POSITION, PREV], j]) for j in range(n)]
    assert set(seen) == expected  # 16 entries in 4 steps of 5: every one, the first again at the wrap
    s = e.manager.stats()
    # 5 entries at each of the c1 prefill, c2 prefill and live prefill steps (c0 alone was 5), then 4 steps of 5
    assert s["cached_entries"] == {"full": 16} and s["swept_entries"]["full"] == 3 * 5 + 4 * 5


def test_evicted_prefixes_are_no_longer_swept():
    e, got = cached_engine(budget=4)
    gone = cached_slots(e, "c1")
    e.manager.evict_prefix("c1")
    for slot in gone:
        e.flip("full", slot)  # the cache freed them: whatever happens to them is no longer the canary's business
    sweep = e.manager._sweep.sweeps["full"]
    for _ in range(12):
        tick(e)
        n = int(sweep.block[0:1].view(np.int32)[0])
        assert not set(sweep.block[1:1 + n].tolist()) & set(gone)
    e.manager.flush()
    assert got == [] and e.manager.stats()["cached_entries"] == {"full": 9}
    with pytest.raises(KeyError, match=r"kv-canary: key: expected a cached prefix \(cache_prefix first\), got 'c1'"):
        e.manager.evict_prefix("c1")


def test_budget_zero_means_off():
    e, got = cached_engine(budget=0)
    assert not e.manager._sweep and "swept_entries" not in e.manager.stats()
    slot = int(e.r2t_host[1, 0])  # c0's first cached slot
    e.flip("full", slot)
    for _ in range(20):
        tick(e)
    e.manager.flush()
    assert got == []


def test_the_sweep_never_reports_clean_prefixes_under_churn():
    e, got = cached_engine(budget=3)
    rng = np.random.default_rng(1)
    next_id = 0
    for step in range(60):
        if step % 7 == 3:  # cache a fresh prefix with a new request's prefill (this step's tokens)
            rid = f"n{next_id}"
            next_id += 1
            prompt = rng.integers(100, 200, size=int(rng.integers(1, 6))).tolist()
            e.add(rid, prompt)
            e.forward([(rid, len(prompt)), ("live", 0)])
            row = e.reqs[rid]["row"]
            e.finish(rid)  # row reused, slots kept
            e.manager.cache_prefix(rid, e.r2t_host[row, :len(prompt)].copy(), prompt)
            e.r2t_host[row] = 0
        if step % 11 == 5:
            e.manager.evict_prefix(next(iter(e.manager._sweep.keys)))
        tick(e)
    e.manager.flush()
    assert got == []
    assert e.manager.stats()["sweep_passes"]["full"] >= 5


def test_a_prefix_registered_in_the_step_that_writes_it_is_swept_after_the_write():
    got = []
    e = ToyEngine(on_violation=got.append, sweep_budget=64)
    e.add("p", [3, 4, 5, 6])
    row = e.reqs["p"]["row"]
    m = e.manager
    slots = None

    # The engine inserts the prompt into its cache between before_forward and after_kv_store of the prefill.
    real_before = m.before_forward

    def before_then_cache(**kw):
        nonlocal slots
        real_before(**kw)
        slots = e.r2t_host[row, :4].copy()
        m.cache_prefix("p", slots, [3, 4, 5, 6])

    m.before_forward = before_then_cache
    e.forward([("p", 4)])
    m.before_forward = real_before
    m.flush()
    assert got == [] and m.stats()["swept_entries"]["full"] == 4


def test_idle_sweep_calls_and_the_reporting_delay():
    e, got = cached_engine(budget=16)
    slot = cached_slots(e, "c2")[1]
    e.flip("full", slot)
    e.manager.sweep()  # the whole cache in one idle step
    assert got == []  # read back at a later call, never inside the step
    e.manager.sweep()
    (v,) = found(got)
    assert (v.kernel, v.prefixes, v.first_step) == ("sweep", (("c2", 1),), 4)  # steps 0-3: prefills, live
    assert e.manager.stats()["steps"] == 6


def test_a_prefix_source_callable_is_mirrored_each_step():
    got, cache = [], {}
    e = ToyEngine(on_violation=got.append, sweep_budget=4, prefix_source=lambda: cache.values())
    for rid, prompt in PROMPTS.items():
        e.add(rid, prompt)
        e.forward([(rid, len(prompt))])
        row = e.reqs[rid]["row"]
        e.finish(rid, free_row=False)
        cache[rid] = (rid, e.r2t_host[row, :len(prompt)].copy(), prompt)
    m = e.manager
    m.sweep()
    assert m.stats()["cached_entries"] == {"full": 16}
    c1 = cache.pop("c1")[1]
    e.flip("full", int(c1[0]))  # c1 left the cache: not reported
    for _ in range(8):
        m.sweep()
    m.flush()
    assert got == [] and m.stats()["cached_entries"] == {"full": 9}
    e.flip("full", int(cache["c2"][1][2]))
    for _ in range(math.ceil(9 / 4)):
        m.sweep()
    m.flush()
    assert [(v.prefixes, v.kernel) for v in found(got)] == [((("c2", 2),), "sweep")]


def test_group_budgets_and_the_draft_offset():
    r2t = np.zeros((4, 16), dtype=np.int32)
    groups = [KVGroup(name="full", req_to_token=r2t, num_slots=32, verify_capacity=8),
              KVGroup(name="draft", req_to_token=r2t, num_slots=32, verify_capacity=8, sweep_budget=2,
                      kv_token_id_vs_position_offset=1),
              KVGroup(name="swa", req_to_token=r2t, num_slots=32, verify_capacity=8, swa_window_size=4,
                      full_to_swa_index_mapping=np.arange(32, dtype=np.int64))]
    m = CanaryManager(groups, max_batch_size=2, sweep_budget=5)
    assert {n: s.budget for n, s in m._sweep.sweeps.items()} == {"full": 5, "draft": 2}
    m.cache_prefix("k", [4, 5, 6], [10, 11, 12], start_position=7, prev_slot=3)
    assert m._sweep.sweeps["full"].runs["k"].block.tolist() == [[4, 5, 6], [10, 11, 12], [7, 8, 9], [3, 4, 5]]
    assert m._sweep.sweeps["draft"].runs["k"].block[TOKEN].tolist() == [11, 12, -1]
    m.cache_prefix("mid", [9], None, start_position=2, groups=["draft"])
    assert m._sweep.sweeps["draft"].runs["mid"].block[:, 0].tolist() == [9, -1, 2, 0]  # chain link skipped
    assert "mid" not in m._sweep.sweeps["full"].runs


def test_the_bound_holds_for_every_entry_under_random_registration_and_eviction():
    """Model check of the rotation alone: an entry registered when N entries are cached (itself included) is
    staged within ceil(N / B) steps, whatever is registered or evicted meanwhile (docs/integration.md 5b); an
    entry of a registry that does not change is staged again within ceil(N / B) steps."""
    rng = np.random.default_rng(7)
    for budget in (1, 3, 8):
        group = type("G", (), {"name": "full"})()
        sweep = GroupSweep(group, budget, 0, lambda n, dt: np.zeros(n, dt))
        out = np.zeros((4, budget), dtype=np.int64)
        deadline: dict[int, int] = {}  # entry (its slot) -> last step by which it must be staged
        live: dict[int, list[int]] = {}
        next_id = 1
        for step in range(600):
            churn = step < 450  # then a stable registry: every entry again within ceil(N / B) steps
            for _ in range(int(rng.integers(0, 3)) if churn else 0):
                n = int(rng.integers(1, 6))
                ids = list(range(next_id, next_id + n))
                next_id += n
                block = np.zeros((4, n), dtype=np.int64)
                block[SLOT] = ids
                sweep.add(ids[0], block)
                live[ids[0]] = ids
                for i in ids:
                    deadline[i] = step + math.ceil(sweep.total / budget) - 1
            if churn and live and rng.random() < 0.3:
                key = list(live)[int(rng.integers(0, len(live)))]
                sweep.remove(key)
                for i in live.pop(key):
                    deadline.pop(i)
            n = sweep.take(out)
            assert n == min(budget, sweep.total)
            staged = out[SLOT, :n].tolist()
            assert len(set(staged)) == n
            late = [i for i, d in deadline.items() if d < step and i not in staged]
            assert not late, (budget, step, late[:5])
            for i in staged:  # once seen: bounded again only when nothing changes any more
                deadline[i] = step + math.ceil(sweep.total / budget) if not churn else 10**12
def test_argument_errors_name_the_argument():
    r2t = np.zeros((4, 8), dtype=np.int32)
    g = KVGroup(name="full", req_to_token=r2t, num_slots=16, verify_capacity=8)
    with pytest.raises(ValueError, match=r"^kv-canary: sweep_budget: expected an int >= 0 \(0: no sweep\), got -1"):
        CanaryManager(g, max_batch_size=2, sweep_budget=-1)
    bad = KVGroup(name="full", req_to_token=r2t, num_slots=16, verify_capacity=8, sweep_budget=1.5)
    with pytest.raises(ValueError, match=r"^kv-canary: groups\[0\].sweep_budget: expected an int >= 0"):
        CanaryManager(bad, max_batch_size=2)
    swa = KVGroup(name="swa", req_to_token=r2t, num_slots=16, verify_capacity=8, swa_window_size=2, sweep_budget=4,
                  full_to_swa_index_mapping=np.arange(16, dtype=np.int64))
    with pytest.raises(ValueError, match=r"^kv-canary: groups\[0\].sweep_budget: expected 0 for the sliding-window "
                                         r"group 'swa' .*, got 4"):
        CanaryManager(swa, max_batch_size=2)
    with pytest.raises(TypeError, match=r"^kv-canary: prefix_source: expected None or a callable"):
        CanaryManager(g, max_batch_size=2, sweep_budget=2, prefix_source=[1])
    m = CanaryManager(g, max_batch_size=2, sweep_budget=2)
    m.cache_prefix("a", [1, 2], [5, 6])
    cases = [
        (ValueError, r"^kv-canary: key: expected a prefix not yet cached, got 'a'", ("a", [3], [1]), {}),
        (TypeError, r"^kv-canary: key: expected a hashable prefix key, got list", ([1], [3], [1]), {}),
        (ValueError, r"^kv-canary: slots: expected slot ids in \[1, 16\) \(group 'full'.*got slots\[1\] = 16",
         ("b", [3, 16], None), {}),
        (ValueError, r"^kv-canary: slots: expected slot ids in \[1, 16\).*got slots\[0\] = 0", ("b", [0], None), {}),
        (TypeError, r"^kv-canary: slots: expected integer values, got dtype float64", ("b", [1.5], None), {}),
        (ValueError, r"^kv-canary: slots: expected a 1-D array, got shape \(1, 2\)", ("b", np.ones((1, 2), int),
                                                                                     None), {}),
        (ValueError, r"^kv-canary: tokens: expected one token per slot \(2\), got 1", ("b", [3, 4], [1]), {}),
        (ValueError, r"^kv-canary: start_position: expected an int >= 0, got -1", ("b", [3], None, -1), {}),
        (ValueError, r"^kv-canary: prev_slot: expected None or -1 at start_position 0 \(no predecessor\), got 5",
         ("b", [3], None), {"prev_slot": 5}),
        (ValueError, r"^kv-canary: prev_slot: expected -1 or a slot id below 16 \(group 'full'\), got 99",
         ("b", [3], None, 4), {"prev_slot": 99}),
        (ValueError, r"^kv-canary: groups: expected names among \['full'\], got 'draft'", ("b", [3], None),
         {"groups": ["draft"]}),
    ]
    for exc, pattern, args, kw in cases:
        with pytest.raises(exc, match=pattern):
            m.cache_prefix(*args, **kw)
    assert list(m._sweep.keys) == ["a"]  # nothing half-registered


@pytest.mark.gpu
def test_cupy_sweep_finds_a_flip_in_a_cached_prefix_within_the_bound():
    cupy = pytest.importorskip("cupy")
    e, got = cached_engine(budget=3, xp=cupy, device=0)
    slot = cached_slots(e, "c1")[5]
    e.flip("full", slot)
    for _ in range(math.ceil(16 / 3)):
        e.decode_step(["live"])
    e.manager.flush()  # the report of the last of those steps: the reporting delay, made explicit
    (v,) = found(got)
    assert (v.kernel, v.slot, v.position, v.prefixes) == ("sweep", slot, 5, (("c1", 5),))
    e.manager.evict_prefix("c1")
    got.clear()
    for _ in range(8):
        e.decode_step(["live"])
    e.manager.sweep()
    e.manager.flush()
    assert got == []
    e.manager.close()
