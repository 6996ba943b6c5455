"""A toy engine around :class:`canary.CanaryManager`: the tests' stand-in for a serving engine.

Paged KV pools of page size 1 (``req_to_token`` rows of slots from a free list), K and V bytes derived from
``(request, position, token)``, a sliding-window group whose slots are the full slots through a permuting
``full_to_swa_index_mapping``, and an EAGLE-style draft pool (``kv_token_id_vs_position_offset = 1``: the draft
KV at position ``p`` is written with the token at ``p + 1``). ``xp`` is NumPy (reference backend, or Numba's
simulator) or CuPy. The engine calls exactly what docs/integration.md tells an engine to call; faults are
injected by the tests through the attributes (``k``, ``req_to_token``...).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from canary import CanaryManager, KVGroup

MAX_REQS, MAX_SEQ_LEN, NUM_SLOTS, WINDOW = 8, 32, 256, 8
BYTES = 32  # per token, per K or V source


def kv_row(req: int, pos: int, token: int) -> np.ndarray:
    rng = np.random.default_rng((int(req) * 1000003 + int(pos)) * 7919 + int(token))
    return rng.integers(0, 256, size=BYTES, dtype=np.uint8)


class ToyEngine:
    def __init__(self, *, xp: Any = np, groups=("full",), device: Any = "cpu", backend: str = "auto",
                 library: str | None = None, num_layers: int = 1, static: bool = False, max_reqs: int = MAX_REQS,
                 num_slots: int = NUM_SLOTS, max_batch_size: int = 4, verify_capacity: int = 512,
                 max_seq_len: int = MAX_SEQ_LEN, **manager_kw):
        self.xp = xp
        # widths: {array name: dtype} of the step arrays the engine passes (rpi, prefix, ext, loc, tok, pos), int32
        # or int64 each (SPEC 2 (*)); int64 by default
        self.widths = dict(manager_kw.pop("widths", None) or {})
        # static: the step arrays are the same objects every step (one buffer per name and length, refilled), as
        # an engine with static step buffers passes them: the manager then replays its eager calls as CUDA graphs
        self.static = static
        self._bufs: dict = {}
        self.r2t_host = np.zeros((max_reqs, max_seq_len), dtype=np.int32)
        self.req_to_token = xp.asarray(self.r2t_host)
        self.free_slots = list(range(1, num_slots))
        self.free_rows = list(range(1, max_reqs))
        perm = np.random.default_rng(0).permutation(np.arange(1, num_slots))
        lut = np.zeros(num_slots, dtype=np.int64)
        lut[1:] = perm  # full slot -> SWA slot (slot 0 stays the padding slot)
        self.lut_host = lut
        self.lut = xp.asarray(lut)
        # Every layer's K and V, stacked [num_layers, slots, bytes]; the real-KV sources are layer 0's (SGLang's),
        # and with several layers the layer rotation gets them all.
        self.num_layers = num_layers
        self.layers = {g: (xp.zeros((num_layers, num_slots, BYTES), dtype=xp.uint8),
                           xp.zeros((num_layers, num_slots, BYTES), dtype=xp.uint8)) for g in groups}
        self.kv = {g: (k[0], v[0]) for g, (k, v) in self.layers.items()}
        specs = []
        for g in groups:
            k, v = self.kv[g]
            extra = {}
            if num_layers > 1:
                lk, lv = self.layers[g]
                extra["layer_sources"] = [[(lk[i], 1, BYTES), (lv[i], 1, BYTES)] for i in range(num_layers)]
            if g == "swa":
                extra = dict(swa_window_size=WINDOW, full_to_swa_index_mapping=self.lut)
            elif g == "draft":
                extra = dict(kv_token_id_vs_position_offset=1)
            specs.append(KVGroup(name=g, req_to_token=self.req_to_token, num_slots=num_slots, verify_capacity=verify_capacity,
                                 real_kv_sources=[(k, 1, BYTES), (v, 1, BYTES)], **extra))
        self.manager = CanaryManager(specs, max_batch_size=max_batch_size, device=device, backend=backend, library=library,
                                     **manager_kw)
        self.manager.warmup()
        self.reqs: dict[Any, dict] = {}  # rid -> {"row", "tokens", "kv_len", "draft_len"}
        self.groups = groups

    # -- requests -------------------------------------------------------------------------------------------------
    def add(self, rid, prompt) -> None:
        row = self.free_rows.pop(0)
        self.reqs[rid] = {"row": row, "tokens": list(prompt), "kv_len": 0, "draft_len": 0}
        self.manager.add_request(rid, prompt)

    def finish(self, rid, *, free_row: bool = True) -> None:
        req = self.reqs.pop(rid)
        self.manager.finish_request(rid)
        if free_row:
            self.free_rows.insert(0, req["row"])  # reused at once: the row-recycle scenario needs that

    def _alloc(self, row: int, lo: int, hi: int) -> None:
        for p in range(lo, hi):
            if self.r2t_host[row, p] == 0:
                self.r2t_host[row, p] = self.free_slots.pop(0)
        self.req_to_token[row, lo:hi] = self.xp.asarray(self.r2t_host[row, lo:hi])

    def a(self, values, dtype=np.int64, name: str | None = None):
        arr = self.xp.asarray(np.asarray(values, dtype=self.widths.get(name, dtype)))
        if not self.static or name is None:
            return arr
        buf = self._bufs.get((name, arr.shape[0]))
        if buf is None:
            buf = self._bufs[(name, arr.shape[0])] = self.xp.zeros(arr.shape, dtype=arr.dtype)
        buf[...] = arr
        return buf

    # -- one forward ----------------------------------------------------------------------------------------------
    def forward(self, batch, *, group_names=None, write_tokens=None, prefix_override=None, store=True) -> None:
        """One target forward: ``batch`` = list of ``(rid, n_new)``; the new tokens are the request's next known
        tokens (``write_tokens[rid]`` overrides what is written: rejected drafts). Padding rows: ``(None, 0)``."""
        groups = [g for g in (group_names or self.groups) if g != "draft"]
        rpi, prefix, ext, ids, loc, tok, pos = [], [], [], [], [], [], []
        for rid, n in batch:
            if rid is None:
                rpi.append(0), prefix.append(0), ext.append(0), ids.append(None)
                continue
            req = self.reqs[rid]
            p = req["kv_len"] if prefix_override is None or rid not in prefix_override else prefix_override[rid]
            self._alloc(req["row"], p, p + n)
            toks = (write_tokens or {}).get(rid, req["tokens"][p:p + n])
            assert len(toks) == n, (rid, p, n, req["tokens"])
            rpi.append(req["row"]), prefix.append(p), ext.append(n), ids.append(rid)
            loc += self.r2t_host[req["row"], p:p + n].tolist()
            tok += list(toks)
            pos += list(range(p, p + n))
            req["kv_len"] = p + n
        self.manager.before_forward(req_pool_indices=self.a(rpi, name="rpi"), prefix_lens=self.a(prefix, name="prefix"),
                                    extend_seq_lens=self.a(ext, name="ext"), request_ids=ids, groups=groups)
        if store:
            self.store(groups, loc, ids_for(batch, self.reqs, loc), tok, pos)
        self.manager.after_kv_store(out_cache_loc=self.a(loc, name="loc"), input_ids=self.a(tok, name="tok"),
                                    positions=self.a(pos, name="pos"), groups=groups)

    def draft_forward(self, batch) -> None:
        """One draft-model forward: ``(rid, n)`` writes the draft KV of the next ``n`` positions, each with the
        token at position + 1 (which must be known)."""
        rpi, prefix, ext, ids, loc, tok, pos = [], [], [], [], [], [], []
        for rid, n in batch:
            req = self.reqs[rid]
            p = req["draft_len"]
            rpi.append(req["row"]), prefix.append(p), ext.append(n), ids.append(rid)
            loc += self.r2t_host[req["row"], p:p + n].tolist()
            tok += req["tokens"][p + 1:p + 1 + n]
            pos += list(range(p, p + n))
            req["draft_len"] = p + n
        self.manager.before_forward(req_pool_indices=self.a(rpi, name="d_rpi"),
                                    prefix_lens=self.a(prefix, name="d_prefix"), extend_seq_lens=self.a(ext, name="d_ext"),
                                    request_ids=ids, groups=["draft"])
        self.store(["draft"], loc, ids_for(batch, self.reqs, loc), tok, pos)
        self.manager.after_kv_store(out_cache_loc=self.a(loc, name="d_loc"), input_ids=self.a(tok, name="d_tok"),
                                    positions=self.a(pos, name="d_pos"), groups=["draft"])

    def store(self, groups, loc, owners, tok, pos) -> None:
        for g in groups:
            k, v = self.layers[g]
            for s, rid, t, p in zip(loc, owners, tok, pos):
                slot = int(self.lut_host[s]) if g == "swa" else s
                row = kv_row(hash(rid) & 0xFFFF, p, t)
                for layer in range(self.num_layers):  # layer 0's bytes are the row itself
                    k[layer, slot] = self.xp.asarray(row ^ np.uint8(layer))
                    v[layer, slot] = self.xp.asarray(row[::-1] ^ np.uint8(layer))

    def accept(self, rid, tokens) -> None:
        self.reqs[rid]["tokens"] += list(tokens)
        self.manager.accept_tokens(rid, tokens)

    def decode_step(self, rids, *, next_token=lambda rid, n: 1000 + n, batch: bool | str = False) -> None:
        """A decode step of every request in ``rids`` (each writes its last known token), then each accepts one
        sampled token (``batch``: all through one ``accept_tokens_batch``; ``"device"``: its token ids in a device
        array, one static buffer per batch size when the engine keeps static buffers)."""
        self.forward([(rid, len(self.reqs[rid]["tokens"]) - self.reqs[rid]["kv_len"]) for rid in rids])
        toks = [next_token(rid, len(self.reqs[rid]["tokens"])) for rid in rids]
        if not batch:
            for rid, t in zip(rids, toks):
                self.accept(rid, [t])
            return
        for rid, t in zip(rids, toks):
            self.reqs[rid]["tokens"].append(t)
        host = np.array(toks, dtype=np.int64)
        if batch == "device":
            self.manager.accept_tokens_batch(rids, self.a(host, name="sampled"))
            return
        self.manager.accept_tokens_batch(rids, host)

    def slot_of(self, rid, pos: int, group: str = "full") -> int:
        s = int(self.r2t_host[self.reqs[rid]["row"], pos])
        return int(self.lut_host[s]) if group == "swa" else s

    def flip(self, group: str, slot: int, layer: int = 0) -> None:
        """Corrupt one bit of a slot's K bytes in ``layer`` (what a stray write would do)."""
        k = self.layers[group][0]
        k[layer, slot, 3] = k[layer, slot, 3] ^ 0x10


def ids_for(batch, reqs, loc) -> list:
    out = []
    for rid, n in batch:
        if rid is not None:
            out += [rid] * n
    return out


def accept_batch_runs(batch_kind: bool | str = True, **engine_kw) -> list:
    """The same decode steps with tokens accepted per request, then per batch (accept_tokens_batch, ``batch_kind``
    as :meth:`ToyEngine.decode_step`'s ``batch``): each run's ``(pool, counts, violations, protected tokens)``
    (for :func:`check_accept_batch_runs`)."""
    out = []
    for batch in (False, batch_kind):
        got = []
        e = ToyEngine(on_violation=got.append, **engine_kw)
        e.add("a", [5, 6, 7, 8])
        e.add("b", [9, 10])
        e.add("c", [11])
        for _ in range(3):
            e.decode_step(["a", "b", "c"], batch=batch)
        e.decode_step(["c", "a"], batch=batch)  # another batch: its rows looked up again
        for _ in range(2):
            e.decode_step(["a", "b", "c"], batch=batch)
        e.reqs["b"]["tokens"][-1] = 77  # the engine writes a token that was never accepted
        e.decode_step(["a", "b", "c"], batch=batch)
        e.forward([("a", 0), ("b", 0), ("c", 0)])
        e.manager.flush()
        m = e.manager
        rows = {rid: m.requests.live[rid].row for rid in "abc"}
        pool = m.pool_array if isinstance(m.pool_array, np.ndarray) else m.pool_array.get()
        out.append((np.array(pool), {rid: int(m.requests.counts[r]) for rid, r in rows.items()},
                    [(v.position, v.reasons, v.stored_token, v.expected_token, v.requests) for vs in got for v in vs],
                    m.stats()["protected_tokens"]))
        m.close()
    return out


def check_accept_batch_runs(out: list) -> None:
    from canary import FailReason

    (pool_e, counts_e, found_e, prot_e), (pool_b, counts_b, found_b, prot_b) = out
    assert np.array_equal(pool_e, pool_b) and counts_e == counts_b and prot_e == prot_b
    assert found_e == found_b and [(f[1], f[2], f[4][0][0]) for f in found_b] == [(FailReason.VERIFY_TOKEN, 77, "b")]


def mass_corruption(*, requests: int, prompt: int, ring_capacity: int, _no_marks: bool = False, **engine_kw) -> dict:
    """Every prompt slot of ``requests`` requests corrupted at once (``requests * prompt`` slots, many times the
    ring), then decode steps of all of them until every corrupted slot was named (or the bound passed): what the
    callback got, step by step, for the mass-corruption tests (docs/records.md 6.1)."""
    got = []
    k = requests * prompt
    bound = -(-k // ring_capacity)
    e = ToyEngine(on_violation=got.append, ring_capacity=ring_capacity, max_reqs=requests + 2,
                  max_batch_size=requests, num_slots=k + requests * (bound + 4) + 8,
                  verify_capacity=requests * (prompt + bound + 4),
                  max_seq_len=prompt + bound + 4, **engine_kw)
    if _no_marks:
        e.manager._marks.mark = lambda *a: None
    rids = [f"r{i}" for i in range(requests)]
    for i, rid in enumerate(rids):
        e.add(rid, list(range(100 * i, 100 * i + prompt)))
    e.forward([(rid, prompt) for rid in rids])  # the prefill stores every prompt token
    for rid in rids:
        e.accept(rid, [7])
    corrupted = {e.slot_of(rid, p): rid for rid in rids for p in range(prompt)}
    for s in corrupted:
        e.flip("full", s)
    named: dict[int, int] = {}  # slot -> the decode step whose report named it
    steps = seen = 0
    while len(named) < k and steps < bound + 2:
        e.decode_step(rids)
        steps += 1
        for batch in got[seen:]:
            for v in batch:
                named.setdefault(v.slot, steps)
        seen = len(got)
    e.manager.flush()
    return {"engine": e, "got": got, "corrupted": corrupted, "bound": bound, "steps": steps, "rids": rids,
            "named": named}


def check_mass_corruption(run: dict, *, latency: int = 0) -> None:
    """Every corrupted slot named once, none other, within ``bound * (1 + latency)`` steps (docs/records.md 6.1;
    the first decode step's report is read at the second: one step late), every request named, and every step
    whose ring overflowed told the callback how many rows it dropped."""
    got, corrupted = run["got"], run["corrupted"]
    names = [v.slot for batch in got for v in batch]
    assert len(names) == len(set(names)), "a slot named twice"
    assert set(names) == set(corrupted), "a slot named that was not corrupted, or one never named"
    assert max(run["named"].values()) <= run["bound"] * (1 + latency) + 1
    assert {rid for batch in got for v in batch for rid in v.request_ids} == set(run["rids"])
    for v in (v for batch in got for v in batch):
        assert corrupted[v.slot] in v.request_ids  # each names its owner
    assert sum(b.dropped for b in got) == run["engine"].manager.stats()["ring_dropped"]
    assert all(b.dropped or len(b) for b in got)
