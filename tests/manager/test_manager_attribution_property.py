"""Who a report names, under random engine schedules (docs/integration.md 4): requests joining and leaving,
``req_to_token`` rows reused with their previous request's slots left in place past the new request's length (no
engine clears a freed row), freed slots handed to other requests, chunked prefills, decode steps accepting tokens
per request or per batch, batches of changing composition and order with padding rows. One fault at a random step
against a live request (a flipped KV byte, a slot handed to a second request that writes it, a token written at
the wrong slot), on the reference backend through the toy engine. The properties: the fault is reported at the
next verify of its slot, every ``(request, position)`` a report names is one the fault concerns, and a clean
schedule reports nothing."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from helpers.manager_engine import ToyEngine
from hypothesis import HealthCheck, event, given, note, settings, strategies as st

MAX_LIVE, MAX_TOTAL, MAX_STEPS, MAX_BS = 4, 8, 12, 6
MAX_LEN = 30  # tokens a request may reach (the toy engine's rows have 32 columns)
FAULTS = ("flip", "double", "wrong_own", "wrong_other")


@dataclass
class Schedule:
    """``ops``: ``("join", rid, prompt)``, ``("leave", rid, lifo)`` (``lifo``: its slots go to the front of the free
    list, so the next allocations reuse them) and ``("step", batch, accepts, per_batch, fault)``: ``batch`` the
    ``(rid or None, n_new)`` rows of one forward, ``accepts`` ``{rid: tokens}`` accepted after it (``per_batch``:
    one token each, in one ``accept_tokens_batch`` whose id list is ``per_batch``, padding included), ``fault``
    ``None`` or a fault the driver may inject at that step (before its forward for a flip, in its writes otherwise):
    the first one drawn, or a later one whose victim slot another request's stale tail maps."""
    ops: list = field(default_factory=list)
    fault: tuple | None = None


@st.composite
def schedules(draw, faulty: bool = True) -> Schedule:
    kind = draw(st.sampled_from(FAULTS)) if faulty else None
    fault_at = draw(st.integers(0, MAX_STEPS // 2)) if faulty else None
    live: dict[int, list[int]] = {}  # rid -> [written length, known tokens]
    sched = Schedule()
    total = steps = 0
    rejoin = False

    def token() -> int:
        return draw(st.integers(1, 40))  # a small range: requests share tokens (the token checks see equal ones)

    while steps < MAX_STEPS:
        choices = ["step"] * 2 if live else []
        if len(live) < MAX_LIVE and total < MAX_TOTAL:
            choices.append("join")
        if len(live) > 1 or live and total < MAX_TOTAL:  # a leave, then a join: the row (and its slots) reused
            choices.append("leave")
        if not choices:
            break  # every request has come and gone
        op = "join" if rejoin else draw(st.sampled_from(choices))
        rejoin = False
        if op == "join":
            total += 1
            prompt = [token() for _ in range(draw(st.integers(1, 8)))]
            live[total] = [0, len(prompt)]
            sched.ops.append(("join", total, prompt))
            continue
        if op == "leave":
            rid = draw(st.sampled_from(sorted(live)))
            del live[rid]
            sched.ops.append(("leave", rid, draw(st.booleans())))
            # often a join next: the row reused at once, its slots handed out by the next step
            rejoin = total < MAX_TOTAL and len(live) < MAX_LIVE and draw(st.booleans())
            continue
        steps += 1
        order = draw(st.permutations(sorted(live)))
        rids = order[:draw(st.integers(1, len(order)))]
        batch = []
        for rid in rids:
            pending = live[rid][1] - live[rid][0]
            # the usual row writes every known token; a chunked prefill writes part of them
            n = pending if pending == 1 or not draw(st.booleans()) else draw(st.integers(1, pending - 1))
            batch.append((rid, n))
        for _ in range(draw(st.integers(0, MAX_BS - len(batch)))):
            batch.insert(draw(st.integers(0, len(batch))), (None, 0))
        fault = None
        if faulty and steps - 1 >= fault_at:  # every step from here may carry it: the driver injects it once
            fault = _place(draw, kind, live, batch)
            sched.fault = sched.fault or fault
        for rid, n in batch:
            if rid is not None:
                live[rid][0] += n
        done = [rid for rid, n in batch if rid is not None and live[rid][0] == live[rid][1]]
        per_batch = None
        if done and draw(st.booleans()):
            per_batch = list(draw(st.permutations(done)))
            for _ in range(draw(st.integers(0, 1))):
                per_batch.insert(draw(st.integers(0, len(per_batch))), None)
            accepts = {rid: [token()] for rid in done}
        else:
            accepts = {rid: [token() for _ in range(1 if live[rid][1] >= MAX_LEN - 1 else draw(st.integers(1, 2)))]
                       for rid in done}
        for rid, toks in accepts.items():
            live[rid][1] += len(toks)
        sched.ops.append(("step", batch, accepts, per_batch, fault))
        for rid in [r for r, (_, k) in live.items() if k >= MAX_LEN]:  # full: it leaves
            del live[rid]
            sched.ops.append(("leave", rid, draw(st.booleans())))
    if live:  # a last decode step of every live request: a fault's victim still running gets verified
        order = draw(st.permutations(sorted(live)))
        sched.ops.append(("step", [(rid, live[rid][1] - live[rid][0]) for rid in order], {}, None, None))
    return sched


def _place(draw, kind: str, live: dict, batch: list) -> tuple | None:
    """The fault of ``kind`` at a step with ``batch`` (``None``: none possible here): ``(kind, writer, its first new
    position, pick, stale)``, the victim and its position left to :meth:`Driver.resolve` (it knows the slots)."""
    written = [rid for rid, (kv, _) in live.items() if kv > 0]
    writers = sorted(rid for rid, n in batch if rid is not None and n > 0)
    if kind == "flip":
        w = None
        if not written:
            return None
    else:
        if kind == "wrong_own":  # the writer's first new token lands in the slot of one of its own positions
            ws = [w for w in writers if live[w][0] > 0]
        else:  # double: the allocator hands the victim's slot to w's first new position, which w then writes;
            # wrong_other: w's first new token is written through the victim's slot (its own never written)
            ws = [w for w in writers if any(v != w for v in written)]
        if not ws:
            return None
        w = draw(st.sampled_from(ws))
    # stale: prefer a victim slot that another live request's row maps through its stale tail
    return (kind, w, None if w is None else live[w][0], draw(st.integers(0, 1 << 16)), draw(st.booleans()))


class Driver:
    """Runs a :class:`Schedule` on a :class:`ToyEngine`, allocating slots itself (fresh ones over a reused row's
    stale columns; a finished request's slots back on the free list) and injecting the fault."""

    def __init__(self, sched: Schedule):
        self.got: list = []
        self.e = ToyEngine(on_violation=self.got.append, max_batch_size=MAX_BS)
        self.sched = sched
        steps = [op for op in sched.ops if op[0] == "step"]
        self.last_fault = max((i for i, op in enumerate(steps) if op[4] is not None), default=None)
        self.step = 0
        self.override: dict = {}  # (rid, column) -> the slot the allocator hands out there
        self.tainted: set = set()  # slots two rows map (or a stray write hit): never freed
        self.live_at: list = []  # per step: the live requests when its report is decoded (the next step, or flush)
        self.batches: list = []  # per step: the requests in its batch
        self.effect: int | None = None  # the step whose forward the fault hit (a flip: before its verify)
        self.target: tuple | None = None  # (rid, position, slot) whose next verify must report the fault
        self.kv_len: dict = {}  # rid -> its written length (kept after it leaves)
        self.written: list = []  # per step: every request's written length after its forward
        self.fault: tuple | None = None  # the fault injected, resolved: (kind, w, q, v, p)
        self.same = False  # the fault wrote what the slot held already (the same token, position and prefix)

    def run(self) -> None:
        e = self.e
        for op in self.sched.ops:
            if op[0] == "join":
                e.add(op[1], op[2])
            elif op[0] == "leave":
                self.leave(op[1], op[2])
            else:
                self.forward(*op[1:])
        e.manager.flush()
        self.live_at.append(set(e.reqs))
        self.live_at = self.live_at[1:]  # a step's report is decoded by the next forward's before_forward

    def leave(self, rid, lifo: bool) -> None:
        e = self.e
        req = e.reqs[rid]
        slots = [int(s) for s in e.r2t_host[req["row"], :req["kv_len"]] if int(s) not in self.tainted]
        e.finish(rid)  # the row is reused as it is: its columns past the next request's length stay stale
        if lifo:
            e.free_slots[0:0] = slots
        else:
            e.free_slots += slots

    def forward(self, batch, accepts, per_batch, fault) -> None:
        e = self.e
        self.live_at.append(set(e.reqs))
        if fault is not None and self.fault is None:
            self.inject(batch, fault)
        for rid, n in batch:
            if rid is None:
                continue
            req = e.reqs[rid]
            for col in range(req["kv_len"], req["kv_len"] + n):
                slot = self.override.pop((rid, col), None)
                e.r2t_host[req["row"], col] = e.free_slots.pop(0) if slot is None else slot
        self.batches.append({rid for rid, _ in batch if rid is not None})
        e.forward(batch)
        self.step += 1
        self.kv_len.update({rid: r["kv_len"] for rid, r in e.reqs.items()})
        self.written.append(dict(self.kv_len))
        if per_batch is not None:
            for rid in accepts:
                e.reqs[rid]["tokens"] += accepts[rid]
            e.manager.accept_tokens_batch(per_batch, [accepts[rid][0] if rid is not None else 0 for rid in per_batch])
        else:
            for rid, toks in accepts.items():
                e.accept(rid, toks)

    def resolve(self, fault, last: bool) -> tuple | None:
        """``(kind, w, q, v, p)``: the drawn fault with its victim ``v`` and position ``p`` picked; ``None`` (wait for
        a later step) when it asks for a victim slot in a stale tail and none is, unless it is the ``last``."""
        e = self.e
        kind, w, q, pick, stale = fault
        if isinstance(pick, tuple):  # a hand case names its victim and position
            return (kind, w, q) + pick
        if kind == "flip":
            victims = list(e.reqs)
        elif kind == "wrong_own":
            victims = [w]
        else:
            victims = [v for v in e.reqs if v != w]
        cands = [(v, p) for v in sorted(victims) for p in range(e.reqs[v]["kv_len"])]
        if stale:
            tails = {int(x) for rid, r in e.reqs.items() for x in e.r2t_host[r["row"], r["kv_len"]:] if x}
            hit = [(v, p) for v, p in cands if e.slot_of(v, p) in tails]
            if hit:
                event("victim slot in another row's stale tail")
            elif not last:
                return None
            cands = hit or cands
        return (kind, w, q) + cands[pick % len(cands)]

    def inject(self, batch, fault) -> None:
        e = self.e
        got = self.resolve(fault, self.step == self.last_fault)
        if got is None:
            return
        self.fault = kind, w, q, v, p = got
        s = e.slot_of(v, p)
        if kind == "flip":
            e.flip("full", s)
            self.effect, self.target = self.step, (v, p, s)
            return
        self.tainted.add(s)
        self.effect, self.target = self.step + 1, (v, p, s)  # written after this step's verify
        # The same tokens at the same positions make the same KV and the same record chain: nothing to see there
        # (w's own slot at q, in the wrong-slot cases, is still reported)
        self.same = q == p and e.reqs[w]["tokens"][:q + 1] == e.reqs[v]["tokens"][:p + 1]
        if kind == "double":
            self.override[(w, q)] = s
            return
        at = 0  # the token index of w's first new token (padding rows carry none)
        for rid, n in batch:
            if rid == w:
                break
            at += n
        real = e.store

        def once(groups, loc, owners, tok, pos):
            loc[at] = s  # the same list goes to after_kv_store: the record lands where the bytes did
            e.store = real
            return real(groups, loc, owners, tok, pos)

        e.store = once

    def allowed(self) -> set:
        """The ``(request, position)`` pairs the fault concerns: its victim at the corrupted position (and the
        next one, whose CHAIN check reads the corrupted record), and the writer at the position it wrote (and the
        next one) or, handed the victim's slot, at the position its row maps it."""
        if self.fault is None:
            return set()
        kind, w, q, v, p = self.fault
        if kind == "flip":
            return {(v, p)}
        if kind == "double":
            return {(v, p), (v, p + 1), (w, q)}
        return {(v, p), (v, p + 1), (w, q), (w, q + 1)}

    def found(self) -> list:
        return [v for vs in self.got for v in vs]


def _describe(d: Driver) -> str:
    return "\n".join(f"{v.first_step} {v.line()}" for v in d.found())


def check(sched: Schedule) -> Driver:
    note(f"ops={sched.ops!r}")
    d = Driver(sched)
    d.run()
    found = d.found()
    note(f"fault={d.fault!r}\n{_describe(d)}")
    if d.fault is None:
        assert found == [] and all(not b.dropped for b in d.got), _describe(d)
        return d
    allowed = d.allowed()
    for v in found:
        bad = (set(v.requests) | set(v.writers)) - allowed
        # KNOWN_GAP (the strict xfail below): a request of the step that finished before its report was decoded,
        # its row reused since. Told apart so that the property still catches every other misattribution.
        t = v.first_step
        gap = {(r, q) for r, q in bad if r not in d.live_at[t]}
        if gap:
            event("known gap: a finished request's reused row read")
        assert not bad - gap, f"named {sorted(bad - gap)} outside {sorted(allowed)}: {v.line()}"
    event(f"fault {d.fault[0]}")
    rid, pos, slot = d.target
    # the next verify of the slot: the first step at or after the fault's effect with the victim in its batch
    nxt = next((t for t in range(d.effect, d.step) if rid in d.batches[t]), None)
    if nxt is None or d.same:
        return d  # the victim left before a verify read the slot (ids are never reused: in a batch, it is live)
    event("fault verified: a report required")
    hits = [v for v in found if (v.slot, v.position) == (slot, pos)]
    assert hits and min(v.first_step for v in hits) == nxt, f"expected a report at step {nxt}\n{_describe(d)}"
    if rid in d.live_at[nxt]:
        assert any((rid, pos) in v.requests for v in hits), _describe(d)
    if d.fault[0] == "double":
        w, q = d.fault[1:3]
        if w in d.live_at[nxt]:
            # at the victim's own position the writer holds the slot too: a holder, not a writer
            assert any((w, q) in (v.requests if q == pos else v.writers) for v in hits), _describe(d)
    return d


_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=400, **_SETTINGS)
@given(schedules())
def test_a_fault_is_reported_at_its_next_verify_and_names_only_whom_it_concerns(sched):
    check(sched)


@settings(max_examples=100, **_SETTINGS)
@given(schedules(faulty=False))
def test_a_clean_schedule_reports_nothing(sched):
    check(sched)


# Minimal cases the property found (shrunk by hand): the first two named a request through its reused row's columns
# it had not written (fixed: attribution.py holds), the last is a known gap kept as a strict xfail. Each runs
# through the same driver; ``Schedule`` ops as above, the fault's victim and position given.

def _run(ops: list, fault: tuple) -> list:
    d = Driver(Schedule(ops=ops, fault=fault))
    d.run()
    return [(v.slot, v.position, v.requests, v.writers) for v in d.found()]


def test_a_request_not_in_the_batch_is_not_named_through_its_unwritten_column():
    flip = ("flip", None, None, (3, 0), False)
    got = _run([("join", 1, [1, 2]), ("step", [(1, 2)], {1: [5]}, None, None), ("leave", 1, True),
                ("join", 2, [7]), ("step", [(2, 1)], {2: [8]}, None, None),  # its row's column 1: 1's slot, stale
                ("join", 3, [9]), ("step", [(3, 1)], {3: [11]}, None, None),  # 3 gets that slot at position 0
                ("step", [(3, 1)], {3: [12]}, None, flip)], flip)
    assert got == [(2, 0, ((3, 0),), ())], got


def test_a_chunked_prefill_is_not_named_through_its_unwritten_prompt_columns():
    flip = ("flip", None, None, (3, 2), False)
    got = _run([("join", 3, [9]), ("step", [(3, 1)], {3: [10]}, None, None),
                ("join", 1, [1, 2, 3, 4, 5, 6]), ("step", [(1, 6)], {1: [5]}, None, None), ("leave", 1, True),
                ("step", [(3, 1)], {3: [11]}, None, None),
                ("join", 2, [7] * 6), ("step", [(2, 2), (3, 1)], {3: [12]}, None, None),  # 2 writes 2 of 6
                ("step", [(3, 1)], {3: [12]}, None, flip)], flip)
    assert got == [(5, 2, ((3, 2),), ())], got


@pytest.mark.xfail(strict=True, reason="decode.py holders()/writers() read a step's batch rows when the report is "
                   "decoded (the next before_forward), after the engine reused a finished request's req_to_token row "
                   "and allocated the next step: request 1's corrupted slot (position 2), freed and handed to request "
                   "3 at column 1 of the same row, reports requests=() and writers=1@1")
def test_a_finished_requests_report_reads_its_row_as_its_step_did():
    flip = ("flip", None, None, (1, 2), False)
    got = _run([("join", 2, [5]), ("join", 1, [1, 2, 3, 4]),
                ("step", [(1, 4), (2, 1)], {1: [5], 2: [6]}, None, None),
                ("step", [(1, 1)], {1: [6]}, None, flip), ("leave", 1, True),  # verified, then finished
                ("join", 3, [7, 8, 9]), ("step", [(2, 1), (3, 3)], {2: [7], 3: [1]}, None, None)], flip)
    assert got == [(3, 2, ((1, 2),), ())], got
