"""Hostile inputs to the manager's step calls (a reviewing helper's findings): no record is written from a bad
input, a failing call writes nothing for any group, and every error is a ``kv-canary:`` one naming its argument.

- An SWA group's slots are the mapping's only for slots inside it: -1 (a token whose KV is not stored) stays -1
  and is skipped, a slot past the mapping becomes a slot of no pool that the write reports as ``SLOT_RANGE``
  (a plain gather read the mapping's last entry for -1 and overwrote a real record). On the host here, and with
  torch and CuPy arrays on a GPU (``gpu`` marker).
- ``after_kv_store`` checks (or translates) every group's slots before any group writes.
- ``after_kv_store`` writes only groups the step planned (another group's write plan is a stale one).
- Token ids are integers in the int32 pool's range, checked on the host (``add_request``, ``accept_tokens``,
  ``accept_tokens_batch``); ``accept_tokens_batch(ids, None)`` is an error, not a silent no-op.
"""
from __future__ import annotations

import numpy as np
import pytest

from canary import CanaryManager, FailReason, KVGroup
from canary.manager.slots import OUT_OF_MAPPING

R2T = np.arange(64, dtype=np.int32).reshape(4, 16)


def _groups(xp=np, device="cpu"):
    r2t = xp.asarray(R2T)
    lut = xp.asarray(np.arange(64, dtype=np.int64)[::-1].copy())  # full slot s -> SWA slot 63 - s
    full = KVGroup(name="full", req_to_token=r2t, num_slots=64, verify_capacity=1024)
    swa = KVGroup(name="swa", req_to_token=r2t, num_slots=64, verify_capacity=1024, swa_window_size=4,
                  full_to_swa_index_mapping=lut)
    return full, swa


def _step(m, xp=np, ids=("A",), groups=None):
    m.before_forward(req_pool_indices=xp.asarray(np.array([1], np.int64)), prefix_lens=xp.asarray(np.zeros(1, np.int64)),
                     extend_seq_lens=xp.asarray(np.array([3], np.int64)), request_ids=list(ids), groups=groups)


def _records(m, name):
    g = next(g for g in m.groups if g.name == name)
    buf = g.records.state.canary_buffer
    host = buf.get() if hasattr(buf, "get") else (buf.cpu().numpy() if hasattr(buf, "cpu") else np.asarray(buf))
    return np.array(host, copy=True)


def _manager(xp=np, device="cpu", groups=("full", "swa"), **kw):
    full, swa = _groups(xp, device)
    chosen = [g for g in (full, swa) if g.name in groups]
    got = []
    m = CanaryManager(chosen, max_batch_size=8, device=device, on_violation=got.append, **kw)
    m.warmup()
    m.add_request("A", [1, 2, 3])
    return m, got


def _slot_range_rows(got):
    return sorted(v.slot for vs in got for v in vs if v.reasons & FailReason.SLOT_RANGE)


def _check_swa_translation(xp, device, width=np.int64, **kw):
    m, got = _manager(xp, device, groups=("swa",), **kw)
    _step(m, xp)
    before = _records(m, "swa")
    loc = xp.asarray(np.array([16, -1, 100], width))  # a stored token, one skipped, one past the mapping
    m.after_kv_store(out_cache_loc=loc, input_ids=xp.asarray(np.array([1, 2, 3], width)),
                     positions=xp.asarray(np.array([0, 1, 2], width)))
    m.flush()
    after = _records(m, "swa")
    changed = sorted(set(np.flatnonzero((before != after).any(axis=1)).tolist()))
    assert changed == [63 - 16]  # the stored token's SWA slot only: lut[-1] = slot 0's record is untouched
    assert _slot_range_rows(got) == [OUT_OF_MAPPING]  # the slot past the mapping, reported
    m.close()


@pytest.mark.parametrize("width", [np.int64, np.int32])
def test_swa_slots_keep_minus_one_and_report_a_slot_past_the_mapping(width):
    _check_swa_translation(np, "cpu", width)


def test_swa_slots_of_int32_torch_cpu_tensors():
    torch = pytest.importorskip("torch")

    class T:
        @staticmethod
        def asarray(a):
            return torch.as_tensor(a)
    _check_swa_translation(T, "cpu", np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("lib", ["cupy", "torch", "torch_library"])
def test_swa_slots_on_the_gpu(lib):
    from helpers.gpu_guard import backend_or_skip

    backend_or_skip("cupy")
    if lib.startswith("torch"):
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs torch with CUDA")

        class T:
            @staticmethod
            def asarray(a):
                return torch.as_tensor(a, device="cuda:0")
        _check_swa_translation(T, 0, **({"library": "torch"} if lib == "torch_library" else {}))
    else:
        import cupy

        _check_swa_translation(cupy, 0)


def test_a_bad_group_slot_fails_the_call_before_any_group_writes():
    m, got = _manager()
    _step(m)
    before = {n: _records(m, n) for n in ("full", "swa")}
    ids, pos = np.array([1, 2, 3], np.int64), np.array([0, 1, 2], np.int64)
    for by_group, exc, words in [
        ({"swa": np.array([16], np.int64)}, ValueError, r"out_cache_loc_by_group\['swa'\]: expected \[N\] slots, "
                                                        r"one per token of input_ids \(\[3\]\), got shape \(1,\)"),
        ({"swa": np.array([16, 17, 18], np.int16)}, TypeError,
         r"out_cache_loc_by_group\['swa'\]: expected dtype int32 or int64 slots, got int16"),
    ]:
        with pytest.raises(exc, match="^kv-canary: " + words):
            m.after_kv_store(out_cache_loc=np.array([16, 17, 18], np.int64), input_ids=ids, positions=pos,
                             out_cache_loc_by_group=by_group)
        assert all(np.array_equal(before[n], _records(m, n)) for n in before)
    with pytest.raises(TypeError, match=r"^kv-canary: out_cache_loc: expected dtype int32 or int64 slots, got int16"):
        m.after_kv_store(out_cache_loc=np.array([16, 17, 18], np.int16), input_ids=ids, positions=pos)
    assert all(np.array_equal(before[n], _records(m, n)) for n in before)
    m.after_kv_store(out_cache_loc=np.array([16, 17, 18], np.int64), input_ids=ids, positions=pos)  # a retry works
    m.flush()
    assert got == []
    m.close()


def test_after_kv_store_writes_only_groups_the_step_planned():
    m, got = _manager()
    ids, pos, loc = np.array([1, 2, 3], np.int64), np.array([0, 1, 2], np.int64), np.array([16, 17, 18], np.int64)
    _step(m)
    m.after_kv_store(out_cache_loc=loc, input_ids=ids, positions=pos)
    m.add_request("B", [4])
    m.before_forward(req_pool_indices=np.array([2], np.int64), prefix_lens=np.zeros(1, np.int64),
                     extend_seq_lens=np.array([1], np.int64), request_ids=["B"], groups=["full"])
    before = _records(m, "swa")
    with pytest.raises(ValueError, match=r"^kv-canary: groups: expected groups this step's before_forward planned "
                                         r"\(\['full'\]\), got \['swa'\]"):
        m.after_kv_store(out_cache_loc=np.array([32], np.int64), input_ids=np.array([4], np.int64),
                         positions=np.zeros(1, np.int64), groups=["swa"])
    # groups=None: the step's groups, not every group (the SWA group's last write plan is step 0's)
    m.after_kv_store(out_cache_loc=np.array([32], np.int64), input_ids=np.array([4], np.int64),
                     positions=np.zeros(1, np.int64))
    m.flush()
    assert np.array_equal(before, _records(m, "swa")) and got == []
    m.close()


@pytest.mark.parametrize("tokens, exc, words", [
    ([1.9, 2.7], TypeError, "expected integer token ids"),
    (["12", "13"], TypeError, "expected integer token ids"),
    ("123", TypeError, "expected integer token ids"),
    (np.array([np.nan]), TypeError, "expected integer token ids"),
    ([True], TypeError, "expected integer token ids"),
    ([1, None], TypeError, "expected integer token ids"),
    ({1, 2}, TypeError, "expected integer token ids"),
    ([[1, 2], [3, 4]], ValueError, "expected one dimension of token ids"),
    (np.array([2**64 - 1], np.uint64), ValueError, r"expected token ids in \[0, 2\*\*31\)"),
    ([2**40 + 7], ValueError, r"expected token ids in \[0, 2\*\*31\)"),
    ([2**63], ValueError, r"expected token ids in \[0, 2\*\*31\)"),
    ([-1], ValueError, r"expected token ids in \[0, 2\*\*31\)"),
])
def test_token_ids_are_checked_integers_in_the_pool_range(tokens, exc, words):
    m = CanaryManager(_groups()[0], max_batch_size=4)
    with pytest.raises(exc, match="^kv-canary: prompt_token_ids: " + words):
        m.add_request("x", tokens)
    assert "x" not in m.requests.live  # refused before it was registered
    m.add_request("y", [5])
    with pytest.raises(exc, match="^kv-canary: token_ids: " + words):
        m.accept_tokens("y", tokens)
    assert int(m.requests.counts[m.requests.live["y"].row]) == 1
    m.close()


def test_accept_tokens_batch_checks_token_ids():
    m = CanaryManager(_groups()[0], max_batch_size=4)
    m.add_request("a", [5])
    for toks, exc, words in [
        (None, TypeError, r"token_ids: expected one token id per request \(\[1\] host ints or a device array\), "
                          r"got None"),
        (np.array([2**64 - 1], np.uint64), ValueError, r"token_ids: expected token ids in \[0, 2\*\*31\)"),
        ([2**40], ValueError, r"token_ids: expected token ids in \[0, 2\*\*31\)"),
        (np.int64(5), ValueError, r"token_ids: expected one token per request \(\[1\]\)"),
    ]:
        with pytest.raises(exc, match="^kv-canary: " + words):
            m.accept_tokens_batch(["a"], toks)
    assert int(m.requests.counts[m.requests.live["a"].row]) == 1
    m.accept_tokens_batch(["a"], [7])
    assert int(m.requests.counts[m.requests.live["a"].row]) == 2
    m.close()


def test_wrong_kinds_of_step_arguments_are_kv_canary_errors_and_leave_no_step_open():
    m = CanaryManager(_groups()[0], max_batch_size=8)
    m.add_request("A", [1, 2, 3])
    one = dict(prefix_lens=np.zeros(1, np.int64), extend_seq_lens=np.array([3], np.int64))
    calls = [
        (lambda: m.before_forward(req_pool_indices=[1], request_ids=["A"], **one),
         r"req_pool_indices: expected a \[bs\] int32 or int64 array, got list"),
        (lambda: m.before_forward(req_pool_indices=None, request_ids=["A"], **one),
         r"req_pool_indices: expected a \[bs\] int32 or int64 array, got NoneType"),
        (lambda: m.before_forward(req_pool_indices=np.array(1), request_ids=["A"], **one),
         r"req_pool_indices: expected a \[bs\] int32 or int64 array, got ndarray of shape \(\)"),
        (lambda: m.before_forward(req_pool_indices=np.array([1]), request_ids=[["A"]], **one),
         r"request_ids\[0\]: expected a hashable request id \(or None\), got list"),
        (lambda: m.before_forward(req_pool_indices=np.array([1]), request_ids=(x for x in ["A"]), **one),
         r"request_ids: expected a list of bs = 1 request ids \(None for padding rows\), got generator"),
        (lambda: m.before_forward(req_pool_indices=np.array([1]), request_ids=["A"], groups=5, **one),
         r"groups: expected a list of group names among \['full'\], got int"),
        (lambda: m.add_request(["x"], [1]), r"request_id: expected a hashable engine request id"),
        (lambda: m.accept_tokens(["A"], [1]), r"request_id: expected a hashable engine request id"),
        (lambda: m.finish_request({}), r"request_id: expected a hashable engine request id"),
        (lambda: m.accept_tokens_batch([["A"]], [1]), r"request_ids\[0\]: expected a hashable request id"),
    ]
    for call, words in calls:
        with pytest.raises(TypeError, match="^kv-canary: " + words):
            call()
    m.before_forward(req_pool_indices=np.array([1], np.int64), request_ids=["A"], **one)  # no step left open
    m.after_kv_store(out_cache_loc=np.array([16, 17, 18], np.int64), input_ids=np.array([1, 2, 3], np.int64),
                     positions=np.array([0, 1, 2], np.int64))
    m.close()


def test_wrong_constructor_arguments_are_kv_canary_errors_naming_them():
    from canary import CanaryRecords, CanaryState, VerifyPlan, WritePlan

    g = _groups()[0]
    layer = [(np.zeros((64, 64), np.uint8), 1, 64)]
    for call, exc, words in [
        (lambda: CanaryManager(None, max_batch_size=8), TypeError,
         r"groups: expected a KVGroup or a list of KVGroups, got NoneType"),
        (lambda: CanaryManager(KVGroup(name="f", req_to_token=R2T, num_slots=64, verify_capacity=8,
                                       real_kv_sources=None), max_batch_size=8), TypeError,
         r"real_kv_sources: expected a sequence of sources"),
        (lambda: CanaryRecords(CanaryState.allocate(num_slots=64), 5), TypeError,
         r"real_kv_sources: expected a sequence of sources"),
        (lambda: CanaryManager(KVGroup(name="f", req_to_token=np.zeros(4, np.int32), num_slots=64, verify_capacity=8),
                               max_batch_size=8), ValueError,
         r"groups\[0\].req_to_token: expected a \[max_reqs, max_seq_len\] int32 array, got shape \(4,\)"),
        (lambda: CanaryManager(KVGroup(name="f", req_to_token=R2T.astype(np.int64), num_slots=64, verify_capacity=8),
                               max_batch_size=8), TypeError, r"groups\[0\].req_to_token: expected dtype int32, got int64$"),
        (lambda: CanaryManager(KVGroup(name="f", block_table=np.zeros((4, 2), np.float32), page_size=16, num_slots=64,
                                       verify_capacity=8), max_batch_size=8), TypeError,
         r"groups\[0\].block_table: expected dtype int32 or int64, got float32$"),
        (lambda: CanaryManager(KVGroup(name="f", block_table=np.zeros(8, np.int64), page_size=16, num_slots=64,
                                       verify_capacity=8), max_batch_size=8), ValueError,
         r"groups\[0\].block_table: expected a \[max_reqs, max_blocks\] int32 or int64 array, got shape \(8,\)$"),
        (lambda: CanaryManager(KVGroup(name="f", kv_indptr=np.zeros(9, np.int64), kv_indices=np.zeros(8, np.uint32),
                                       page_size=1, max_reqs=4, max_seq_len=8, num_slots=64, verify_capacity=8),
                               max_batch_size=8), TypeError,
         r"groups\[0\].kv_indices: expected dtype int32 or int64, got uint32$"),
        (lambda: CanaryManager(KVGroup(name="f", req_to_token=R2T, num_slots=64, verify_capacity=8, layer_sources=5),
                               max_batch_size=8), TypeError,
         r"groups\[0\].layer_sources: expected a list of per-layer source lists"),
        (lambda: CanaryManager(KVGroup(name="f", req_to_token=R2T, num_slots=64, verify_capacity=8,
                                       layer_sources=[layer, layer], layer_real_kv_mode="bogus"), max_batch_size=8),
         ValueError, r"groups\[0\].layer_real_kv_mode: expected 'partial' or 'all'.*got 'bogus'"),
        (lambda: VerifyPlan.allocate(verify_capacity=2**62), ValueError,
         r"verify_capacity: expected an int in \[0, 2\*\*31 - 1\], got 4611686018427387904"),
        (lambda: WritePlan.allocate(write_req_capacity=2**31), ValueError,
         r"write_req_capacity: expected an int in \[0, 2\*\*31 - 1\]"),
        (lambda: CanaryState.allocate(num_slots=2**63), ValueError,
         r"size: expected \d+ elements of uint8 to fit on device 'cpu', got an allocation failure"),
        (lambda: CanaryManager(g, max_batch_size=2**62), ValueError, r"size: expected \d+ elements of int64"),
    ]:
        with pytest.raises(exc, match="^kv-canary: " + words):
            call()
    pytest.importorskip("prometheus_client")
    with pytest.raises(TypeError, match=r"^kv-canary: metrics: expected None, True \(the default registry\) or a "
                                        r"prometheus_client CollectorRegistry, got int"):
        CanaryManager(g, max_batch_size=8, metrics=5)


@pytest.mark.parametrize("lut, exc, words", [
    (np.zeros(64, np.int32), TypeError, r"expected dtype int64, got int32$"),
    (np.zeros((8, 8), np.int64), ValueError, r"expected a \[lut_len\] int64 array, got shape \(8, 8\)$"),
    (None, ValueError, r"expected a \[lut_len\] int64 array with swa_window_size = 4, got None$"),
])
def test_an_swa_groups_mapping_is_refused_in_the_groups_words(lut, exc, words):
    """full_to_swa_index_mapping is refused naming the group (the second here), at the constructor and at rebind:
    the planner's bare argument name would not say which of several groups it is."""
    full = KVGroup(name="f", req_to_token=R2T, num_slots=64, verify_capacity=8)
    swa = KVGroup(name="s", req_to_token=R2T, num_slots=64, verify_capacity=8, swa_window_size=4,
                  full_to_swa_index_mapping=lut)
    want = r"^kv-canary: groups\[1\]\.full_to_swa_index_mapping: " + words
    with pytest.raises(exc, match=want):
        CanaryManager([full, swa], max_batch_size=8)
    m = CanaryManager([full, KVGroup(name="s", req_to_token=R2T, num_slots=64, verify_capacity=8, swa_window_size=4,
                                     full_to_swa_index_mapping=np.arange(64, dtype=np.int64))], max_batch_size=8)
    planner = m.groups[1].planner
    with pytest.raises(exc, match=want):
        m.rebind("s", full_to_swa_index_mapping=lut)
    assert m.groups[1].planner is planner
