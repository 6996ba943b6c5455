"""The manager's layer rotation (docs/integration.md 5c) on the reference backend: a flipped bit in the last
layer is found within num_layers steps, at exactly the step whose cursor reaches that layer, and the report
names the group, the layer, the step and every request holding the slot."""
from __future__ import annotations

import pytest
from helpers.manager_engine import ToyEngine

from canary import FailReason, KVGroup
from canary.manager import CanaryManager


def _engine(num_layers: int, got: list, **kw) -> ToyEngine:
    e = ToyEngine(num_layers=num_layers, on_violation=got.append, **kw)
    e.add("a", [5, 6, 7, 8])
    e.add("b", [9, 10])
    for _ in range(3):
        e.decode_step(["a", "b"])
    return e


@pytest.mark.parametrize("num_layers", [2, 3, 5])
@pytest.mark.parametrize("after_steps", [0, 1, 2])
def test_layer_rotation_finds_a_flip_in_the_last_layer_within_num_layers_steps(num_layers, after_steps):
    got: list = []
    e = _engine(num_layers, got)
    for _ in range(after_steps):
        e.decode_step(["a", "b"])
    e.manager.flush()
    assert got == []
    g = e.manager.groups[0]
    layer_now, _ = g.layers.cursor()
    last = num_layers - 1
    wait = (last - layer_now) % num_layers  # steps before the step whose verify checks the last layer
    first = e.manager.stats()["steps"]
    e.flip("full", e.slot_of("a", 1), layer=last)
    for _ in range(num_layers + 1):
        e.decode_step(["a", "b"])
    e.manager.flush()
    found = [v for vs in got for v in vs]
    assert len(found) == 1, [v.line() for v in found]
    v = found[0]
    assert (v.group, v.kernel, v.layer, v.position, v.reasons) == ("full", "verify", last, 1, FailReason.REAL_KV)
    assert v.first_step == first + wait and wait < num_layers
    assert v.requests == (("a", 1),) and v.slot == e.slot_of("a", 1)
    assert f" layer={last} " in v.line() and v.line().startswith("kv-canary: violation group=full kernel=verify")
    # Seen again on each later step whose cursor is on the last layer: a repeat, not a new report.
    assert v.count == 1 + sum(1 for s in range(first + wait + 1, first + num_layers + 1)
                              if (s - first - wait) % num_layers == 0)


def test_layer_zero_flip_is_found_by_both_checks_and_other_layers_only_by_the_rotation():
    got: list = []
    e = _engine(3, got)
    e.flip("full", e.slot_of("b", 0), layer=0)
    e.flip("full", e.slot_of("a", 2), layer=1)
    for _ in range(3):
        e.decode_step(["a", "b"])
    e.manager.flush()
    found = {(v.kernel, v.layer, v.position, v.request_ids) for vs in got for v in vs}
    # Layer 0 is seen by the main verify's real-KV check (layer 0, SGLang's) and the rotation in the same step:
    # one record, of both rows
    assert found == {("verify", 0, 0, ("b",)), ("verify", 1, 2, ("a",))}
    (v0,) = [v for vs in got for v in vs if v.position == 0]
    assert [r.kernel.name for r in v0.rows] == ["VERIFY", "VERIFY_LAYER"] and v0.raw is v0.rows[0]
    assert all(v.reasons == FailReason.REAL_KV for vs in got for v in vs)


def test_rewritten_slots_refresh_every_layer_and_clean_runs_report_nothing():
    runs = {}
    for num_layers in (1, 4):
        got: list = []
        e = _engine(num_layers, got)
        for _ in range(6):
            e.decode_step(["a", "b"])
        e.manager.flush()
        assert got == []
        runs[num_layers] = e.manager.stats()
    # The rotation counts in the verify counters (docs/records.md 10.3): every verified entry twice.
    assert runs[4]["verified_entries"]["full"] == 2 * runs[1]["verified_entries"]["full"]
    assert runs[4]["written_entries"] == runs[1]["written_entries"]


def test_rotation_defaults_and_errors():
    e = ToyEngine(num_layers=1)
    assert e.manager.groups[0].layers is None
    e2 = ToyEngine(num_layers=2)
    assert e2.manager.groups[0].layers is not None and e2.manager.groups[0].layers.num_layers == 2
    import numpy as np

    r2t = np.zeros((4, 8), dtype=np.int32)
    k = np.zeros((2, 16, 32), dtype=np.uint8)
    layers = [[(k[0], 1, 32)], [(k[1], 1, 32)]]
    off = CanaryManager([KVGroup(name="g", req_to_token=r2t, num_slots=16, verify_capacity=8, layer_sources=layers,
                                 layer_rotation=False)], max_batch_size=2)
    assert off.groups[0].layers is None
    with pytest.raises(ValueError, match=r"^kv-canary: groups\[0\]\.layer_sources: expected the per-layer"):
        CanaryManager([KVGroup(name="g", req_to_token=r2t, num_slots=16, verify_capacity=8, layer_rotation=True)],
                      max_batch_size=2)
    bad = [[(k[0], 1, 32)], [(k[1], 1, 16)]]
    with pytest.raises(ValueError, match=r"^kv-canary: layer_sources\[1\]\[0\]: expected num_bytes_per_token = 32"):
        CanaryManager([KVGroup(name="g", req_to_token=r2t, num_slots=16, verify_capacity=8, layer_sources=bad)],
                      max_batch_size=2)
    with pytest.raises(ValueError, match=r"^kv-canary: groups\[0\].layer_dwell: expected an int in \[1, 2\*\*31\), got 0"):
        CanaryManager([KVGroup(name="g", req_to_token=r2t, num_slots=16, verify_capacity=8, layer_sources=layers,
                               layer_dwell=0)], max_batch_size=2)
    with pytest.raises(ValueError, match=r"^kv-canary: groups\[0\].layer_real_kv_mode: expected 'partial' or 'all'"):
        CanaryManager([KVGroup(name="g", req_to_token=r2t, num_slots=16, verify_capacity=8, layer_sources=layers,
                               layer_real_kv_mode="none")], max_batch_size=2)


@pytest.mark.gpu
def test_cupy_layer_rotation_finds_a_flip_in_the_last_layer_within_num_layers_steps():
    cupy = pytest.importorskip("cupy")
    got: list = []
    num_layers = 4
    e = ToyEngine(xp=cupy, device=0, num_layers=num_layers, on_violation=got.append)
    e.add("a", [5, 6, 7, 8])
    e.add("b", [9, 10])
    for _ in range(3):
        e.decode_step(["a", "b"])
    e.manager.flush()
    assert got == []
    layer_now, _ = e.manager.groups[0].layers.cursor()
    wait = (num_layers - 1 - layer_now) % num_layers
    first = e.manager.stats()["steps"]
    e.flip("full", e.slot_of("a", 2), layer=num_layers - 1)
    for _ in range(num_layers):
        e.decode_step(["a", "b"])
    e.manager.flush()
    found = [v for vs in got for v in vs]
    assert [(v.layer, v.position, v.reasons, v.requests, v.first_step) for v in found] == \
        [(num_layers - 1, 2, FailReason.REAL_KV, (("a", 2),), first + wait)]
    e.manager.close()
