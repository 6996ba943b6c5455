"""Fault injectors for the simulated engine (:mod:`canary.replay.engine`): the corruptions the canary must catch.

Nineteen kinds, each a hook on one step (``KIND@STEP`` on the command line):

| kind | when | what |
| --- | --- | --- |
| ``kv-flip`` | after the write | one bit of one real K byte flips, at a cached position of a running request |
| ``overwrite`` | before the write | another request's last new token lands in a cached slot of a running request |
| ``position`` | before the write | a running request's last new token is written with position + 1 |
| ``token`` | before the write | a running request's last new token is written with token + 1 |
| ``stale-row`` | after the write | ``req_to_token`` keeps a finished request's slot where a reused row got a new one |
| ``zero-kv`` | after the write | a cached position of a running request is pointed to a slot no request ever wrote |
| ``swa-evict`` | after the write | the LUT entry of a running request's cached position inside its window is cleared |
| ``spec-reject`` | before the write | a decoding request's new token is a rejected draft: KV and record (and the write's assert) get the draft, the pool the accepted token |
| ``row-recycle`` | after the write | a running request's ``req_to_token`` row gets another running request's slots (the row reused while still read) |
| ``kv-flip-last`` | after the write | as ``kv-flip``, in the last layer's K bytes (``--num-layers`` >= 2: only the layer rotation reads them), at a request running ``dwell * L`` more tokens |
| ``offload-stale`` | at a restore | a page of the restored request gets an older host copy, of another request |
| ``offload-swap`` | at a restore | two whole pages of the restored request are restored into each other's places |
| ``offload-partial`` | at a restore | the restored request's last page is not restored: its slots keep what they held |
| ``offload-foreign`` | at a restore | a page's K bytes are another request's, under the right records |
| ``pd-flip`` | at a transfer | one K byte of the request's middle position flips in flight (after the sender's digest) |
| ``pd-drop-layer`` | at a transfer | the last layer is not transferred (``--num-layers`` >= 2): its decode slots keep old bytes |
| ``pd-zero`` | at a transfer | the middle position's decode slot is left all zero: KV bytes of every layer and record row |
| ``rank-diverge`` | before the write | ``--ranks`` >= 2: a running request's last new token is not written on the last rank (its record and KV lost there alone) |
| ``rank-flip`` | after the write | ``--ranks`` >= 2: as ``kv-flip``, on the last rank only |

``zero-kv`` is a prefix-cache hit on a block that was registered for reuse before its KV store ran: the request
reads an all-zero canary record and all-zero KV bytes. Its slot comes from a page that was never handed out, taken
out of the pool for good. ``swa-evict`` is an SWA page freed while the window still needs it: the plan gives that
position ``MISSING_SLOT`` and verify reports ``MISSING``. It needs a sliding window (``--swa-window``): without one
there is no LUT to clear (refused before the run; here it is never applied, ``not applied: needs --swa-window
...``, which fails the run like any fault never applied). ``kv-flip``, ``kv-flip-last``, ``zero-kv`` and
``swa-evict`` corrupt a mid-window position (neither the window's first nor the write's seed), so a sliding window
of fewer than 4 positions can never apply them (``not applied: needs --swa-window >= 4 (or none)``);
:func:`requirement` names what each kind needs.

The ``offload-*`` kinds need a host tier (``--offload-tier``; :mod:`canary.replay.tier`): each edits the
:class:`~canary.replay.tier.Restore` plan of the first restore at or after its step (which tier entry each new slot
gets), before the KV bytes and records are scattered, and the step's verify reads the result. ``offload-partial``
skips a restore whose new last page already holds its bytes (the request's own old page), ``offload-stale`` one with
no earlier copy of another request left in the tier.

The ``pd-*`` kinds need ``--pd`` (:mod:`canary.replay.pd`): each edits the first prefill-to-decode transfer at or
after its step whose prompt has at least 4 tokens, between the sender's digest and the arrival; the receiver's digest
check catches each at the arrival (reason ``DIGEST``, kernel ``digest``), the decode instance's verify too
(``pd-drop-layer``: once the layer rotation reaches the last layer); the other kinds are applied on the decode
instance. The ``rank-*`` kinds need ``--ranks`` >= 2 (:mod:`canary.replay.ranks`): every rank picks the same request
and slot, only the last rank corrupts it, and the ranks' agreement (SPEC 4.3) reports it on every rank
(``RANK_DIVERGE`` in the step itself, ``RANK_VIOLATION`` in the step whose verify reads the flipped byte).

``spec-reject`` and ``row-recycle`` leave self-consistent records (chain, positions and real KV agree): only the
expected-token pool sees them. ``spec-reject`` is speculative decoding's rejected draft left in the KV: the
forward was fed the draft, so the write's own token assert agrees with it, and the pool holds the accepted
token (the engine scatters accepted tokens only). ``row-recycle`` is overlap scheduling handing a request's
``req_to_token`` row to another request while a forward of the first still reads it: the row now names the
other request's slots and records. With the engine's pool keyed by request (the default) the first request's
pool row still holds its own tokens; keyed by the row (``pool_by_request=False``), the other request's tokens
are scattered into that pool row too, as its own steps would do, and nothing fires: the blind spot that
``expected_token_pool_indices`` closes.

A fault that cannot be applied at its step (no running request with a cached prefix, no reused row...) is
applied at the first later step where it can. Each picks requests that no earlier fault touched, and positions
the next verify reads (inside the sliding window too), so that every applied fault is detectable. The
:class:`Fault` records what was done: the corrupted slot and position, the requests and slots it involves (the
replay attributes violations to faults by those).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .engine import K_BYTES, TOKEN_MASK, EngineKV, StepData, kv_bytes, token_of, window_start
from .tier import HostTier, Restore


@dataclass
class Fault:
    """A requested fault and, once applied, what it did (``-1``: not applicable / not applied)."""

    kind: str
    requested_step: int
    applied_step: int | None = None
    slot: int = -1  # the canary slot whose record or KV bytes are now wrong
    position: int = -1  # the position the plan expects at ``slot``
    written_position: int = -1  # position / token the canary write got at ``slot`` (overwrite, position, token)
    written_token: int = -1
    expected_token: int = -1  # the true token at ``position`` (overwrite, token)
    requests: tuple[int, ...] = ()  # trace ids of the requests involved
    slots: tuple[int, ...] = ()  # every slot the fault made wrong (``slot`` first)
    needs: str = ""  # set when the replay lacks what the kind needs (it can then never be applied)

    @property
    def applied(self) -> bool:
        return self.applied_step is not None

    def describe(self, last_step: int | None = None, interrupted: bool = False) -> str:
        """What the fault did, or why it was never applied: ``last_step`` is the replay's last step (``None``:
        it ran none), ``interrupted`` whether the replay stopped there before the trace's end."""
        if not self.applied:
            if self.needs:
                return f"not applied: needs {self.needs}"
            if last_step is None:
                return "not applied: the replay ran no step"
            if self.requested_step > last_step:
                ended = "the replay was interrupted" if interrupted else "the trace ended"
                return f"not applied: {ended} at step {last_step}, before step {self.requested_step}"
            return (f"not applied: no step from {self.requested_step} to the last ({last_step}) had a request it "
                    f"could corrupt")
        parts = [f"slot {self.slot} pos {self.position}"]
        if self.written_position not in (-1, self.position):
            parts.append(f"written as pos {self.written_position}")
        if self.written_token != -1 and self.written_token != self.expected_token:
            parts.append(f"token {self.written_token} for {self.expected_token}")
        return ", ".join(parts)


MID_WINDOW_KINDS = ("kv-flip", "kv-flip-last", "zero-kv", "swa-evict", "rank-flip")


def requirement(kind: str, *, swa_window: int, num_layers: int, offload_tier: int = 0, pd: bool = False,
                ranks: int = 1) -> str:
    """What a replay with these options lacks for ``kind`` to ever be applied (the option it needs, as typed on
    the command line), or ``""``. The command line refuses such a fault before the run
    (:func:`canary.replay.options.check_arguments`); the hooks below still check, for other callers."""
    if kind in MID_WINDOW_KINDS and 0 < swa_window < 4:
        # a mid-window position: neither the window's first nor the write's seed
        return "--swa-window >= 4 (or none)"
    if kind == "swa-evict" and not swa_window:
        return "--swa-window (a sliding window: its LUT entry is what the fault clears)"
    if KINDS[kind][0] == RESTORE and not offload_tier:
        return "--offload-tier (a host tier: the fault is applied at a restore from it)"
    if KINDS[kind][0] == TRANSFER and not pd:
        return "--pd (a prefill-to-decode split: the fault is applied to a transfer between the instances)"
    if kind == "pd-drop-layer" and num_layers < 2:
        return "--num-layers >= 2 (a layer to leave out of the transfer while layer 0 is sent)"
    if kind.startswith("rank-") and ranks < 2:
        return "--ranks >= 2 (tensor-parallel ranks: the fault corrupts one rank only)"
    if kind == "kv-flip-last" and num_layers < 2:
        return "--num-layers >= 2 (the last layer's K bytes, which only the layer rotation reads)"
    return ""


def _window_too_small(kv: EngineKV, f: Fault) -> bool:
    """Kinds that corrupt a mid-window position (neither the window's first nor the write's seed) need a
    sliding window of at least 4 positions; a smaller one can never apply them."""
    if 0 < kv.window < 4:
        f.needs = "--swa-window >= 4 (or none)"
        return True
    return False


def _candidates(d: StepData, taken: set[int]) -> list[int]:
    """Batch rows whose request keeps running after this step and that no earlier fault touched."""
    req = d.step.request_ids
    return [i for i in range(len(d.rows)) if d.continues[i] and int(req[i]) not in taken]


def _mid_window(kv: EngineKV, d: StepData, taken: set[int]):
    """``(batch row, window start, window end)`` of each candidate whose window holds at least 4 positions: the
    kinds that corrupt a position mid-window (neither its first nor the write seed ``end - 1``)."""
    for i in _candidates(d, taken):
        end = int(d.prefix[i] + d.extend[i])
        lo = window_start(end, kv.window)
        if end - lo >= 4:
            yield i, lo, end


def _kv_flip(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    if _window_too_small(kv, f):
        return False
    for i, lo, end in _mid_window(kv, d, taken):
        q = (lo + end) // 2
        slot = kv.host_slot(int(d.rows[i]), q)
        kv.kv_token_bytes(slot)[5] ^= 0x04
        _record(f, d, slot=slot, position=q, requests=(i,), slots=(slot,))
        return True
    return False


def _kv_flip_last(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    if _window_too_small(kv, f):
        return False
    # The rotation reaches the last layer within layer_dwell * num_layers steps: pick a request running that long.
    if kv.num_layers < 2:
        f.needs = "--num-layers >= 2"
        return False
    for i, lo, end in _mid_window(kv, d, taken):
        if int(kv.sched.kv_len[d.step.request_ids[i]]) - end < kv.layer_dwell * kv.num_layers + 1:
            continue
        q = (lo + end) // 2
        slot = kv.host_slot(int(d.rows[i]), q)
        kv.kv_token_bytes(slot, kv.num_layers - 1)[5] ^= 0x04
        _record(f, d, slot=slot, position=q, requests=(i,), slots=(slot,))
        return True
    return False


def _overwrite(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    req = d.step.request_ids
    for a in _candidates(d, taken):
        p = int(d.prefix[a])
        lo = window_start(p + int(d.extend[a]), kv.window)
        if p < 3 or p - lo < 3:  # a cached position the next verify reads, not written by this step
            continue
        b = next((i for i in range(len(d.rows)) if i != a and int(req[i]) not in taken), None)
        if b is None:
            return False
        q = (lo + p) // 2
        slot = kv.host_slot(int(d.rows[a]), q)
        k = d.last_entry(b)
        own = int(d.out_cache_loc[k])
        d.out_cache_loc[k] = slot  # b's KV bytes and canary record land in a's slot; b's own slot keeps stale ones
        _record(f, d, slot=slot, position=q, written_position=int(d.positions[k]), written_token=int(d.input_ids[k]),
                expected_token=int(token_of(req[a], q)), requests=(a, b), slots=(slot, own))
        return True
    return False


def _position(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    for i in _candidates(d, taken):
        if d.prefix[i] > 0:
            k = d.last_entry(i)
            q = int(d.prefix[i] + d.extend[i]) - 1
            d.positions[k] += 1
            slot = int(d.out_cache_loc[k])
            _record(f, d, slot=slot, position=q, written_position=q + 1, requests=(i,), slots=(slot,))
            return True
    return False


def _token(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    for i in _candidates(d, taken):
        k = d.last_entry(i)
        q = int(d.prefix[i] + d.extend[i]) - 1
        tok = int(token_of(d.step.request_ids[i], q))
        d.input_ids[k] = (tok + 1) & TOKEN_MASK
        slot = int(d.out_cache_loc[k])
        _record(f, d, slot=slot, position=q, written_token=(tok + 1) & TOKEN_MASK, expected_token=tok,
                requests=(i,), slots=(slot,))
        return True
    return False


def _stale_row(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    for i in _candidates(d, taken):
        row, p0, end = int(d.rows[i]), int(d.prefix[i]), int(d.prefix[i] + d.extend[i])
        # Position 0 has no chain predecessor to check; the next verify must read the position.
        pos = np.arange(max(p0, 1, window_start(end, kv.window)), end)
        old, new = kv.prev_r2t[row, pos].astype(np.int64), kv.r2t[row, pos].astype(np.int64)
        ok = (old != 0) & (old != new)
        if kv.lut is not None:
            ok &= kv.lut[old] != 0  # a freed SWA page maps to the padding slot, which verify skips
        hit = np.flatnonzero(ok)
        if not len(hit):
            continue
        p = int(pos[hit[0]])
        right = kv.host_slot(row, p)
        kv.r2t[row, p] = old[hit[0]]  # a finished request's slot, which this step's allocation replaced
        slot = kv.host_slot(row, p)
        _record(f, d, slot=slot, position=p, requests=(i,), slots=(slot, right))
        return True
    return False


def _zero_kv(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    if _window_too_small(kv, f):
        return False
    for i, lo, end in _mid_window(kv, d, taken):
        pages = kv.sched.reserve_unused_pages()
        if pages is None:
            return False
        full_page, swa_page = pages
        row, q, ps = int(d.rows[i]), (lo + end) // 2, kv.page_size
        right = kv.host_slot(row, q)
        fresh = full_page * ps + q % ps  # the page offset a slot of position q has
        if kv.lut is not None:
            kv.lut[fresh] = swa_page * ps + q % ps
        kv.r2t[row, q] = fresh
        slot = kv.host_slot(row, q)
        # Zero already (no request ever stored to it); zeroed anyway, so that the fault never rests on that.
        kv.kv_token_bytes(slot)[:] = 0
        kv.v[slot] = 0
        _record(f, d, slot=slot, position=q, requests=(i,), slots=(slot, right))
        return True
    return False


def _swa_evict(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    if _window_too_small(kv, f):
        return False
    if kv.lut is None:
        f.needs = "--swa-window"
        return False
    for i, lo, end in _mid_window(kv, d, taken):  # mid-window, so that the write seed (end - 1) keeps its slot
        row, q = int(d.rows[i]), (lo + end) // 2
        raw = int(kv.r2t[row, q])
        slot = int(kv.lut[raw]) if raw > 0 else 0
        if slot == 0:
            continue
        kv.lut[raw] = 0  # the SWA slot is freed; the full slot and the request's row still name the position
        _record(f, d, slot=slot, position=q, requests=(i,), slots=(slot,))
        return True
    return False


def _spec_reject(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    for i in _candidates(d, taken):
        if d.extend[i] != 1 or d.prefix[i] == 0:  # a decode step: its token is the one a draft proposed
            continue
        k = d.last_entry(i)
        q = int(d.prefix[i])
        tok = int(token_of(d.step.request_ids[i], q))
        draft = tok ^ 0x2A5  # any other 15-bit token
        d.input_ids[k] = draft
        d.write_expected_tokens[k] = draft  # what the forward was fed: the write's assert agrees
        slot = int(d.out_cache_loc[k])
        _record(f, d, slot=slot, position=q, written_token=draft, expected_token=tok, requests=(i,), slots=(slot,))
        return True
    return False


def _row_recycle(kv: EngineKV, d: StepData, f: Fault, taken: set[int]) -> bool:
    req = d.step.request_ids
    cands = _candidates(d, taken)
    for a in cands:
        end_a = int(d.prefix[a] + d.extend[a])
        for b in cands:
            end_b = int(d.prefix[b] + d.extend[b])
            # Positions A's next verify reads that B holds in its own window (B's slots there are live)
            lo = max(window_start(end_a, kv.window), window_start(end_b, kv.window))
            hi = min(end_a, end_b)
            if b == a or hi <= lo or not (token_of(req[a], np.arange(lo, hi)) != token_of(req[b], np.arange(lo, hi))).any():
                continue
            x, y = int(d.rows[a]), int(d.rows[b])
            kv.r2t[x, lo:hi] = kv.r2t[y, lo:hi]  # row x now names B's slots: the allocator handed it to B
            if not kv.pool_by_request:  # B's tokens scattered into the recycled row's pool row
                kv.pool[x, lo:hi] = kv.pool[y, lo:hi]
            slots = tuple(kv.host_slot(x, p) for p in range(lo, hi))
            _record(f, d, slot=slots[0], position=lo, requests=(a, b), slots=slots)
            return True
    return False


def _restore_page(tier: HostTier, r: Restore, j: int) -> np.ndarray:
    """Indices into ``r.slots`` of the restored request's page ``j`` (its positions ``j * ps`` onward)."""
    ps = tier.kv.page_size
    return np.arange(j * ps, min((j + 1) * ps, len(r.slots)), dtype=np.int64)


def _mid_page(tier: HostTier, r: Restore) -> int:
    return (len(r.slots) - 1) // tier.kv.page_size // 2


def _offload_stale(tier: HostTier, r: Restore, f: Fault, taken: set[int]) -> bool:
    old = tier.stale_copy(r.request, 1)
    if r.request in taken or old is None:
        return False
    # The middle page, or the last the earlier copy covers: its entries at the same positions
    page = _restore_page(tier, r, min(_mid_page(tier, r), max(old.n // tier.kv.page_size - 1, 0)))
    page = page[page < old.n]
    for src in (r.rec_src, r.k_src, r.v_src):  # the earlier copy's entries at the same positions
        src[page] = old.start + page
    _record_restore(f, r, page, requests=(r.request,))
    return True


def _offload_swap(tier: HostTier, r: Restore, f: Fault, taken: set[int]) -> bool:
    ps = tier.kv.page_size
    a = max(_mid_page(tier, r) - 1, 0)
    if r.request in taken or (a + 2) * ps > len(r.slots):  # two whole pages
        return False
    pa, pb = _restore_page(tier, r, a), _restore_page(tier, r, a + 1)
    for src in (r.rec_src, r.k_src, r.v_src):
        src[pa], src[pb] = src[pb].copy(), src[pa].copy()
    _record_restore(f, r, np.concatenate([pa, pb]), requests=(r.request,))
    return True


def _offload_partial(tier: HostTier, r: Restore, f: Fault, taken: set[int]) -> bool:
    if r.request in taken:
        return False
    page = _restore_page(tier, r, (len(r.slots) - 1) // tier.kv.page_size)
    xp = tier.kv.xp
    held = tier._k_view()[0, xp.asarray(r.slots[page])]
    # New slots that already hold these very bytes (the request's own old page, handed back) hide the fault.
    if bool((held == tier.k[0, xp.asarray(r.k_src[page])]).all()):
        return False
    for src in (r.rec_src, r.k_src, r.v_src):
        src[page] = -1
    _record_restore(f, r, page, requests=(r.request,))
    return True


def _offload_foreign(tier: HostTier, r: Restore, f: Fault, taken: set[int]) -> bool:
    if r.request in taken:
        return False
    page = _restore_page(tier, r, _mid_page(tier, r))
    other = (r.request + 1) % len(tier.kv.sched.trace)  # another request's block: its K bytes at these positions
    k = kv_bytes(np.full(len(page), other), page)[:, :K_BYTES]
    for i, b in zip(page.tolist(), k):
        r.k_bytes[i] = np.stack([b ^ layer for layer in range(tier.kv.num_layers)]).astype(np.uint8)
    _record_restore(f, r, page, requests=(r.request,))
    return True


def _record_restore(f: Fault, r: Restore, page: np.ndarray, *, requests: tuple[int, ...]) -> None:
    """Mark ``f`` applied at the restore's step; ``page``: indices into ``r.slots`` (positions) it made wrong."""
    f.applied_step = r.step
    f.requests = requests
    f.slot, f.position = int(r.slots[page[0]]), int(page[0])
    f.slots = tuple(int(s) for s in r.slots[page])


def _record(f: Fault, d: StepData, *, requests: tuple[int, ...], **facts) -> None:
    """Mark ``f`` applied at this step; ``requests`` are batch rows, recorded as trace request ids."""
    f.applied_step = d.step.index
    f.requests = tuple(int(d.step.request_ids[i]) for i in requests)
    for name, value in facts.items():
        setattr(f, name, value)


Apply = Callable[[EngineKV, StepData, Fault, set], bool]
BEFORE_WRITE, AFTER_WRITE, RESTORE, TRANSFER = "before_write", "after_write", "restore", "transfer"
KINDS: dict[str, tuple[str, Any]] = {
    "kv-flip": (AFTER_WRITE, _kv_flip),
    "overwrite": (BEFORE_WRITE, _overwrite),
    "position": (BEFORE_WRITE, _position),
    "token": (BEFORE_WRITE, _token),
    "stale-row": (AFTER_WRITE, _stale_row),
    "zero-kv": (AFTER_WRITE, _zero_kv),
    "swa-evict": (AFTER_WRITE, _swa_evict),
    "spec-reject": (BEFORE_WRITE, _spec_reject),
    "row-recycle": (AFTER_WRITE, _row_recycle),
    "kv-flip-last": (AFTER_WRITE, _kv_flip_last),
    "offload-stale": (RESTORE, _offload_stale),
    "offload-swap": (RESTORE, _offload_swap),
    "offload-partial": (RESTORE, _offload_partial),
    "offload-foreign": (RESTORE, _offload_foreign),
    # Applied by the prefill-to-decode transfer itself (canary.replay.pd), not by a hook of this module.
    "pd-flip": (TRANSFER, None),
    "pd-drop-layer": (TRANSFER, None),
    "pd-zero": (TRANSFER, None),
}
RANK_KINDS = ("rank-diverge", "rank-flip")  # their hooks: canary.replay.ranks, added to KINDS at the end
OFFLOAD_KINDS = tuple(k for k, (when, _) in KINDS.items() if when == RESTORE)
PD_KINDS = tuple(k for k, (when, _) in KINDS.items() if when == TRANSFER)


def parse_inject(text: str) -> Fault:
    """argparse type of ``--inject KIND@STEP``."""
    kind, sep, step = text.partition("@")
    want = f"KIND@STEP with KIND one of {', '.join(KINDS)} and STEP an integer >= 0"
    if not sep or kind not in KINDS:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
    try:
        value = int(step)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r} (STEP {step!r})") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r} (STEP {value})")
    return Fault(kind, value)


@dataclass
class Injector:
    """Applies each fault at its requested step, or at the first later step where it can be applied.

    Pass :meth:`before_write` and :meth:`after_write` as the hooks of :meth:`EngineKV.run`.
    """

    faults: list[Fault]
    taken: set[int] = field(default_factory=set)  # requests touched by applied faults

    def _apply(self, phase: str, kv: EngineKV, d: StepData) -> None:
        for f in self.faults:
            when, apply = KINDS[f.kind]
            if when == phase and not f.applied and f.requested_step <= d.step.index and apply(kv, d, f, self.taken):
                self.taken.update(f.requests)

    def before_write(self, kv: EngineKV, d: StepData) -> None:
        self._apply(BEFORE_WRITE, kv, d)

    def after_write(self, kv: EngineKV, d: StepData) -> None:
        self._apply(AFTER_WRITE, kv, d)

    def at_restore(self, tier: HostTier, r: Restore) -> None:
        """Before ``tier`` carries out the restore ``r``: the ``offload-*`` kinds edit its plan."""
        for f in self.faults:
            when, apply = KINDS[f.kind]
            if when == RESTORE and not f.applied and f.requested_step <= r.step and apply(tier, r, f, self.taken):
                self.taken.update(f.requests)


# The rank-* hooks live with the ranks; importing them adds them to KINDS (either module may be imported first).
from . import ranks as _ranks  # noqa: E402,F401
