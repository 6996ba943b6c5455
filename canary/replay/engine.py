"""The KV side of the simulated engine that ``kv-canary replay`` runs (:mod:`canary.replay.replay_manager`, where a
:class:`canary.CanaryManager` owns the canary): real KV buffers, each step's write entries, the forward's KV stores,
and the accessors the fault injector (:mod:`canary.replay.faults`) corrupts. The tests' engine, which owns a
canary of its own (``CanaryRecords`` and an expected-token pool), extends it in ``tests/helpers/replay_engine.py``.

Arrays: ``xp`` is NumPy (host arrays, reference backend) or CuPy (GPU backends); every array op of the engine
goes through ``xp`` and is vectorized over entries, so the same code runs on both. The scheduler, its
``req_to_token`` and LUT stay host NumPy (the caller mirrors them to the device for the planner).

Synthetic content: the token at ``(request, position)`` is ``splitmix64(request << 32 | position) & 0x7FFF``;
its KV bytes are 12 splitmix64 words of the same pair: 32 bytes in a paged K source ``[pages, page_size, 2, 8]``
float16 and 64 in a token-major V source ``[slots, 64]`` uint8, of which the canary reads 48.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from canary import RealKVMode, real_kv, splitmix64, to_host

from .scheduler import Scheduler, Step

K_BYTES = 32  # per token, paged source
V_BYTES = 64  # per token, token-major source
V_READ = 48  # the canary reads a prefix of each V row: read_bytes < num_bytes_per_token is part of the test
TOKEN_MASK = 0x7FFF


def _splitmix64(x: Any, xp: Any) -> Any:
    """:func:`canary.splitmix64` of NumPy or CuPy int64 arrays (computed on the host), in ``xp``."""
    host = to_host(x) if hasattr(x, "__cuda_array_interface__") else x
    return xp.asarray(splitmix64(host))


def token_of(req: Any, pos: Any, xp: Any = np) -> Any:
    """The true token at ``(request, position)``, elementwise."""
    return _splitmix64((xp.asarray(req, dtype=xp.int64) << 32) | xp.asarray(pos, dtype=xp.int64), xp) & TOKEN_MASK


def kv_bytes(req: Any, pos: Any, xp: Any = np, rank: int = 0) -> Any:
    """``[n, 96]`` uint8: the K bytes then the V bytes of each token; ``rank``: the tensor-parallel rank whose heads
    they are (``--ranks``: each rank holds other bytes of the same tokens; rank 0's are those of one rank)."""
    key = ((xp.asarray(req, dtype=xp.int64) << 24) | xp.asarray(pos, dtype=xp.int64)) * 16
    if rank:
        key = key + (int(rank) << 52)  # above every (request, position) key of a trace: other words, no overlap
    words = _splitmix64(key[:, None] + xp.arange(12, dtype=xp.int64), xp)
    return words.view(xp.uint8).reshape(key.shape[0], 96)


def window_start(end: int, window: int) -> int:
    """First position a verify of prefix ``end`` reads: 0, or ``end - window`` for a sliding window."""
    return max(0, end - window) if window else 0


@dataclass
class StepData:
    """One step's write entries and what the engine knows about them.

    Host NumPy (one value per active batch row): ``rows``, ``prefix``, ``extend``, ``continues`` (the request
    is still running after this step), ``offsets`` (``[n + 1]``: row ``i``'s entries are ``offsets[i]`` to
    ``offsets[i + 1]``). ``xp`` arrays (one value per entry): the rest. A before-write hook may change
    ``out_cache_loc``, ``positions``, ``input_ids`` (what the canary write gets), ``write_expected_tokens``
    (the write's token asserts: what the engine fed the forward, the true tokens unless a fault says otherwise)
    and ``kv_request`` / ``kv_position`` (whose KV bytes are stored); ``true_*`` stay what the plan expects (the
    pool already holds them).
    """

    step: Step
    rows: np.ndarray
    prefix: np.ndarray
    extend: np.ndarray
    continues: np.ndarray
    offsets: np.ndarray
    request: Any
    true_positions: Any
    true_tokens: Any
    out_cache_loc: Any
    positions: Any
    input_ids: Any
    kv_request: Any
    kv_position: Any
    write_expected_tokens: Any = None

    def last_entry(self, i: int) -> int:
        """Index of batch row ``i``'s last entry (every scheduled row has at least one)."""
        return int(self.offsets[i + 1]) - 1


Hook = Callable[["EngineKV", StepData], Any]


class EngineKV:
    """The KV side of the simulated engine: real KV buffers (every layer's K and V), write entries, KV stores.

    ``sched``: the scheduler whose steps are run (its tables size everything). ``xp``: ``numpy`` or ``cupy``.
    ``device``: ``"cpu"`` or a CUDA ordinal. ``backend``: the canary's backend (a subclass's records, the
    client's manager). ``mode``: which real-KV bytes a record hashes. ``num_layers``: layers of K and V, each
    layer's bytes the token's bytes XOR the layer. ``pool`` / ``pool_by_request``: the expected-token pool the
    faults may edit (none here) and how the client keys it (set by the client).
    """

    def __init__(
        self,
        sched: Scheduler,
        *,
        xp: Any = np,
        device: Any = "cpu",
        backend: str = "auto",
        mode: RealKVMode | str = RealKVMode.ALL,
        num_layers: int = 1,
    ):
        self.sched = sched
        self.xp = xp
        self.backend = backend
        self.page_size = ps = sched.page_size
        self.window = sched.swa_window
        # The canary and the KV buffers are indexed by the slots the attention reads: SWA slots in SWA mode.
        self.num_slots = (sched.num_swa_pages if self.window else sched.num_pages) * ps
        self.r2t = sched.req_to_token  # host; faults edit it, the caller mirrors it to the device
        self.lut = sched.full_to_swa_index_mapping
        self.prev_r2t = self.r2t.copy()  # req_to_token before the current step's allocation (stale-row faults)
        # Every layer's K and V stacked; k / v are layer 0's, the real-KV sources (``--num-layers``: the layer
        # rotation gets them all, each layer's bytes the token's bytes XOR the layer).
        self.num_layers = int(num_layers)
        self.layer_dwell = 1  # the rotation's dwell (a manager client sets its group's)
        self.layer_k = xp.zeros((self.num_layers, self.num_slots // ps, ps, 2, 8), dtype=xp.float16)
        self.layer_v = xp.zeros((self.num_layers, self.num_slots, V_BYTES), dtype=xp.uint8)
        self.k, self.v = self.layer_k[0], self.layer_v[0]
        self.real_kv = real_kv([(self.k, ps, K_BYTES), (self.v, 1, V_BYTES, V_READ)], mode)
        # The canary is its client's (a CanaryManager, replay_manager.py); the tests' engine adds one of its own
        # (tests/helpers/replay_engine.py). The faults read the expected-token pool's keying from here.
        self.pool = None
        self.pool_by_request = False
        # This engine's tensor-parallel rank of ``ranks_size`` (``--ranks``, canary.replay.ranks): whose KV bytes
        # it stores, and where the rank-* faults act.
        self.rank, self.ranks_size = 0, 1

    def host_slot(self, row: int, pos: int) -> int:
        """The canary slot of ``req_to_token[row, pos]`` (through the LUT in SWA mode)."""
        raw = int(self.r2t[row, pos])
        return raw if self.lut is None else int(self.lut[raw])

    def layer_sources(self) -> list:
        """Per-layer real-KV sources for the layer rotation (``KVGroup(layer_sources=...)``)."""
        ps = self.page_size
        return [[(self.layer_k[i], ps, K_BYTES), (self.layer_v[i], 1, V_BYTES, V_READ)]
                for i in range(self.num_layers)]

    def kv_token_bytes(self, slot: int, layer: int = 0) -> Any:
        """A writable view of the K bytes of ``slot`` in ``layer`` (for fault injection)."""
        ps = self.page_size
        return self.layer_k[layer].view(self.xp.uint8).reshape(-1, ps, K_BYTES)[slot // ps, slot % ps]

    def entries(self, step: Step, req_to_token: Any, lut: Any) -> StepData:
        """The step's write entries, built on ``xp`` from the planner's own (device) tables."""
        xp, n = self.xp, step.num_active
        rows, prefix, extend = step.req_pool_indices[:n], step.prefix_lens[:n], step.extend_seq_lens[:n]
        offsets = np.concatenate([[0], np.cumsum(extend)]).astype(np.int64)
        d_off = xp.asarray(offsets)
        idx = xp.arange(int(offsets[-1]), dtype=xp.int64)
        # Owner row of each entry without xp.repeat: CuPy's repeat takes no array of counts.
        owner = xp.searchsorted(d_off[1:], idx, side="right")
        pos = xp.asarray(prefix)[owner] + idx - d_off[owner]
        req = xp.asarray(step.request_ids)[owner]
        toks = token_of(req, pos, xp)
        loc = req_to_token[xp.asarray(rows)[owner], pos].astype(xp.int64)
        if lut is not None:
            loc = lut[loc]
        continues = self.sched.kv_len[step.request_ids] > prefix + extend
        return StepData(step=step, rows=rows, prefix=prefix, extend=extend, continues=continues, offsets=offsets,
                        request=req, true_positions=pos, true_tokens=toks, out_cache_loc=loc, positions=pos.copy(),
                        input_ids=toks.copy(), kv_request=req.copy(), kv_position=pos.copy(),
                        write_expected_tokens=toks.copy())

    def store_kv(self, slots: Any, req: Any, pos: Any) -> None:
        """The forward pass's KV stores: each token's bytes into its slot of K and V (slot < 0: none)."""
        ok = slots >= 0
        slots, b = slots[ok], kv_bytes(req[ok], pos[ok], self.xp, self.rank)
        ps = self.page_size
        kb = self.k.view(self.xp.uint8).reshape(-1, ps, K_BYTES)
        kb[slots // ps, slots % ps] = b[:, :K_BYTES]
        self.v[slots] = b[:, K_BYTES:]
        for layer in range(1, self.num_layers):
            kb = self.layer_k[layer].view(self.xp.uint8).reshape(-1, ps, K_BYTES)
            kb[slots // ps, slots % ps] = b[:, :K_BYTES] ^ layer
            self.layer_v[layer][slots] = b[:, K_BYTES:] ^ layer
