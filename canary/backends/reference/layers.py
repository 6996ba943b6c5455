"""NumPy reference of the layer rotation (docs/records.md 10): ``write_layers`` and ``verify_layer``.

The semantics the kernels ``canary_write_layers`` / ``canary_verify_layer`` of ``kernels/records.cu`` and
``kernels/records_numba.py`` reproduce byte for byte. Inputs are validated host arrays
(:class:`canary.records.layers.CanaryLayers` does that); outputs are updated in place.
"""
from __future__ import annotations

import numpy as np

from ...contract.plans import SKIP_SEED
from ...contract.realkv import fold
from ...contract.ring import TOKEN, FailReason, KernelTag, KIND_BITS, append_rows
from ...contract.state import StateViews
from ..args import DEFAULT_LAUNCH, LaunchConfig
from .records import gather_fields, ring_rows

NAME = "reference"
ON_DEVICE = False

_I64 = np.int64


def cursor_layer(cursor: np.ndarray, num_layers: int) -> int:
    """The layer the cursor names: ``cursor[0]`` when in ``[0, num_layers)``, else 0 (a corrupt cursor)."""
    c = int(cursor[0])
    return c if 0 <= c < num_layers else 0


def owner_search(offsets: np.ndarray, nreq: int, n_entries: int) -> np.ndarray:
    """For every entry ``i`` in ``[0, n_entries)``: the last request ``r < nreq`` whose clamped start
    ``clamp(offsets[r], 0, N)`` is ``<= i``, found by the kernels' binary search (-1: none). Exactly that
    search, step by step, so that non-monotone offsets give the kernels' answer too."""
    i = np.arange(n_entries, dtype=_I64)
    lo = np.zeros(n_entries, dtype=_I64)
    hi = np.full(n_entries, nreq, dtype=_I64)
    if nreq == 0:
        return lo - 1
    starts = np.clip(offsets[:nreq], 0, n_entries)
    while True:
        active = lo < hi
        if not active.any():
            return lo - 1
        mid = (lo + hi) >> 1
        right = starts[np.minimum(mid, nreq - 1)] <= i  # mid < nreq wherever active
        lo = np.where(active & right, mid + 1, lo)
        hi = np.where(active & ~right, mid, hi)


def write_layers(state: StateViews, *, layer_hashes: np.ndarray, layer_cursor: np.ndarray, layers, dwell: int,
                 write_offsets: np.ndarray, write_seed_slot_indices: np.ndarray, write_num_valid_reqs: np.ndarray,
                 out_cache_loc: np.ndarray) -> None:
    """One ``write_layers`` launch (docs/records.md 10.2); ``out_cache_loc`` int32 or int64, read widened."""
    out_cache_loc = np.asarray(out_cache_loc).astype(_I64)
    num_layers = len(layers)
    # The cursor first: the kernel's thread 0 does it, and nothing in this launch reads it.
    layer = cursor_layer(layer_cursor, num_layers)
    spent = int(layer_cursor[1]) + 1
    if spent >= dwell or spent < 1:
        layer, spent = (layer + 1) % num_layers, 0
    layer_cursor[0], layer_cursor[1] = layer, spent

    n = out_cache_loc.shape[0]
    nreq = min(max(int(write_num_valid_reqs[0]), 0), write_seed_slot_indices.shape[0])
    r = owner_search(write_offsets, nreq, n)
    has = r >= 0
    rr = np.where(has, r, 0)
    ends = np.clip(write_offsets[rr + 1], 0, n) if nreq else np.zeros(n, dtype=_I64)
    i = np.arange(n, dtype=_I64)
    slot = out_cache_loc
    keep = has & (i < ends) & (write_seed_slot_indices[rr] != SKIP_SEED) & (slot >= 0) & (slot < state.num_slots)
    slots = np.unique(slot[keep])  # a slot written twice gets the same hashes either way
    for lay, kv in enumerate(layers):
        layer_hashes[slots, lay] = fold(kv, slots)


def verify_layer(state: StateViews, *, layer_hashes: np.ndarray, layer_cursor: np.ndarray, layers, tag: int,
                 verify_slot_indices: np.ndarray, verify_expected_tokens: np.ndarray,
                 verify_expected_positions: np.ndarray, verify_num_valid: np.ndarray, enable: np.ndarray) -> None:
    """One ``verify_layer`` launch (docs/records.md 10.3); ``tag``: :func:`canary.contract.ring.encode_layer_tag`'s."""
    ci = KernelTag.VERIFY_LAYER.counter_index
    state.host("kernel_run_counter")[ci] += 1
    if int(enable[0]) == 0:
        return
    cap = verify_slot_indices.shape[0]
    n = min(max(int(verify_num_valid[0]), 0), cap)
    real0 = state.padding_slot == -1  # slot 0 is a real slot: verified like any (SPEC 4)
    live = np.arange(n) if real0 else np.flatnonzero(verify_slot_indices[:n] != 0)
    state.host("slot_run_counter")[ci] += live.shape[0]
    slot = verify_slot_indices[live]
    ok = (slot >= (0 if real0 else 1)) & (slot < state.num_slots)
    live, slot = live[ok], slot[ok]
    if slot.shape[0] == 0:
        return
    layer = cursor_layer(layer_cursor, len(layers))
    fresh = fold(layers[layer], slot)
    stored = layer_hashes[slot, layer]
    bad = np.flatnonzero(stored != fresh)
    if bad.shape[0] and state.reported_slots is not None:
        bad = bad[(state.reported_slots.host[slot[bad]] & 1) == 0]
    if bad.shape[0]:
        rec = gather_fields(state.fields, slot[bad], np.ones(bad.shape[0], dtype=bool))
        rows = ring_rows(tag | (layer << KIND_BITS), slot[bad], verify_expected_positions[live[bad]], rec[:, TOKEN],
                         verify_expected_tokens[live[bad]], stored[bad], fresh[bad],
                         np.full(bad.shape[0], int(FailReason.REAL_KV), dtype=_I64))
        append_rows(state.host("ring"), state.host("ring_write_index"), rows)


class Bound:
    """The reference behind :class:`canary.records.layers.CanaryLayers`."""

    def __init__(self, state: StateViews, views, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.state = state
        self.views = views

    def warmup(self) -> None:
        pass

    def write(self, plan, out_cache_loc, stream: int = 0) -> None:
        v = self.views
        write_layers(self.state, layer_hashes=v.layer_hashes.host, layer_cursor=v.layer_cursor.host,
                     layers=v.kv.layers, dwell=v.dwell, write_offsets=plan.write_offsets.host,
                     write_seed_slot_indices=plan.write_seed_slot_indices.host,
                     write_num_valid_reqs=plan.write_num_valid_reqs.host, out_cache_loc=out_cache_loc.host)

    def verify(self, plan, tag: int, stream: int = 0) -> None:
        v = self.views
        verify_layer(self.state, layer_hashes=v.layer_hashes.host, layer_cursor=v.layer_cursor.host,
                     layers=v.kv.layers, tag=tag, verify_slot_indices=plan.verify_slot_indices.host,
                     verify_expected_tokens=plan.verify_expected_tokens.host,
                     verify_expected_positions=plan.verify_expected_positions.host,
                     verify_num_valid=plan.verify_num_valid.host, enable=plan.enable.host)


def bind(state: StateViews, views, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(state, views, launch)
