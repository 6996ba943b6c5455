"""The replay's prefill-to-decode split (``--pd``): a prefill instance and a decode instance in one process.

Each instance is a :class:`~canary.replay.replay_manager.ManagerReplay` of its own scheduler: its own KV pool
(engine KV buffers), ``req_to_token`` and :class:`canary.CanaryManager`. The prefill scheduler replays the
trace's prompts alone (one output token each: a request leaves it when its prefill completes); a request with
more to generate is then *sent*: a :class:`canary.BlockDigest` over its pages (every layer, K and V) is computed
on the prefill pool, and its KV bytes and record rows (``gather_records``, SPEC 4.1) are copied to a wire
buffer; the prefill pages are freed. At a later step the decode scheduler admits it (new pages, a new row with
``req_to_token`` written for its prefix), the wire is scattered into the decode pool (KV bytes, then the records
with ``scatter_records``) and the digest checked there (SPEC 4.2): a mismatch is a violation of the request,
counted in the summary's ``pd`` object. It then decodes on the decode instance. Every step runs the decode
instance's forward first (arrivals, then decode), then the prefill's; a request sent at step ``t`` arrives at
``t + 1`` at the earliest.

The ``pd-*`` faults (:mod:`canary.replay.faults`) edit a transfer between send and arrival; the other kinds are
applied on the decode instance.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from canary import BlockDigest, to_host

from .engine import K_BYTES, V_BYTES, EngineKV
from .faults import PD_KINDS
from .replay_manager import ManagerReplay
from .report import ProgressLog, provenance
from .scheduler import Scheduler, Trace, _cdiv, default_buckets, load_trace

MAX_SHOWN = 5


class DecodeScheduler(Scheduler):
    """A scheduler whose requests arrive with their prompt already in the KV (from the prefill instance)."""

    def __init__(self, trace: Trace, **kw):
        super().__init__(trace, **kw)
        self.next_request = len(trace)  # nothing from the queue: only arrivals
        self.arrivals: deque[int] = deque()

    @property
    def done(self) -> bool:
        return not self.running and not self.arrivals

    def admit_arrivals(self) -> list[tuple[int, int, int]]:
        """Admit arrived requests in order while the batch has a place and the pool can reserve their whole
        sequence: new pages for the prompt, ``req_to_token`` written; ``(request, row, prefix)`` of each."""
        out, ps = [], self.page_size
        while self.arrivals and len(self.running) < self.max_batch_size:
            req = self.arrivals[0]
            need = int(self.pages_needed[req])
            if self.reserved_pages + need > self.num_pages - 1:
                break
            self.arrivals.popleft()
            prefix = int(self.trace.context_tokens[req])
            row = self.free_rows.pop()
            held = _cdiv(prefix, ps)
            self.page_table[row, :held] = self.free_pages.pop(held)
            pos = np.arange(prefix, dtype=np.int64)
            self.req_to_token[row, :prefix] = self.page_table[row, pos // ps] * ps + pos % ps
            self.row_req[row], self.row_prefix[row] = req, prefix
            self.reserved_pages += need
            self.running.append(row)
            out.append((req, row, prefix))
        self.running.sort(key=lambda r: int(self.row_req[r]))
        return out


@dataclass
class Wire:
    """One request in flight: every layer's K ``[L, n, K_BYTES]`` and V ``[L, n, V_BYTES]`` uint8 bytes, its
    record rows ``[n, row_words]`` int64 and the sender's digests ``[pages]`` int64 (``xp`` arrays)."""

    request: int
    step: int
    k: Any
    v: Any
    records: Any
    digests: Any
    skip_layer: int = -1  # pd-drop-layer: this layer is not copied
    zero_pos: int = -1  # pd-zero: this position's slot is left all zero


def _k_view(kv: EngineKV) -> Any:
    return kv.layer_k.view(kv.xp.uint8).reshape(kv.num_layers, -1, K_BYTES)


def _digest(kv: EngineKV) -> BlockDigest:
    """A digest bound to every layer's K (paged) and V (token-major, read as pages of the same size)."""
    ps, pages = kv.page_size, kv.num_slots // kv.page_size
    layers = [[kv.layer_k[i], kv.layer_v[i].reshape(pages, ps, 4, V_BYTES // 4)] for i in range(kv.num_layers)]
    d = BlockDigest(layers, max_blocks=max(1, int(kv.sched.pages_needed.max(initial=1))))
    d.warmup()
    return d


def _blocks(xp: Any, pages: np.ndarray, n: int, ps: int) -> dict:
    nb = len(pages)
    lens = np.minimum(ps, n - np.arange(nb) * ps)
    return dict(kv_indptr=xp.asarray(np.arange(nb + 1, dtype=np.int64)), kv_indices=xp.asarray(pages.astype(np.int64)),
                block_positions=xp.asarray(np.arange(nb, dtype=np.int64) * ps),
                block_lens=xp.asarray(lens.astype(np.int64)))


class PDReplay:
    """The two instances, the transfers between them and the ``pd-*`` faults."""

    def __init__(self, prefill: ManagerReplay, decode: ManagerReplay, pre_sched: Scheduler, dec_sched: DecodeScheduler):
        self.prefill, self.decode, self.pre_sched, self.dec_sched = prefill, decode, pre_sched, dec_sched
        self.xp = decode.kv.xp
        self.send_digest, self.recv_digest = _digest(prefill.kv), _digest(decode.kv)
        self.wire: dict[int, Wire] = {}
        self.transfers = self.checks = self.blocks = 0
        self.mismatches: list[tuple[int, int, list[int]]] = []  # (step, request, block positions)
        self.digest_hits: dict[int, list[int]] = {}  # fault index: steps of its digest mismatches
        self.unattributed = 0
        self.unattributed_lines: list[str] = []
        self.written = np.zeros(len(dec_sched.trace), dtype=np.int64)

    def send(self, step: int, req: int, row: int) -> None:
        """After the prefill forward: digest, KV bytes and records of ``req``'s prompt onto the wire."""
        kv, xp, ps = self.prefill.kv, self.xp, self.prefill.kv.page_size
        n = int(self.pre_sched.trace.context_tokens[req])
        slots = xp.asarray(kv.r2t[row, :n].astype(np.int64))
        pages = self.pre_sched.page_table[row, : _cdiv(n, ps)]
        digests = xp.zeros(len(pages), dtype=xp.int64)
        self.send_digest.compute(out=digests, **_blocks(xp, pages, n, ps))
        records = self.prefill.manager.allocate_record_rows(n)
        self.prefill.manager.gather_records(slots, records)
        self.wire[req] = Wire(req, step, _k_view(kv)[:, slots].copy(), kv.layer_v[:, slots].copy(), records, digests)
        self.transfers += 1

    def arrive(self, step: int, req: int, row: int, prefix: int) -> None:
        """At the decode admission: the ``pd-*`` faults, then the bytes and records into the new slots, then the
        digest check on the decode pool."""
        w, kv, xp, ps = self.wire.pop(req), self.decode.kv, self.xp, self.decode.kv.page_size
        host_slots = kv.r2t[row, :prefix].astype(np.int64)
        applied = self._faults(step, w, host_slots)
        slots = xp.asarray(host_slots)
        kview = _k_view(kv)
        for layer in range(kv.num_layers):
            if layer != w.skip_layer:
                kview[layer, slots] = w.k[layer]
                kv.layer_v[layer, slots] = w.v[layer]
        if w.zero_pos >= 0:  # the slot keeps nothing: zero bytes and a zero record row
            s = int(host_slots[w.zero_pos])
            kview[:, s] = 0
            kv.layer_v[:, s] = 0
            w.records[w.zero_pos] = 0
        self.decode.manager.scatter_records(w.records, slots)
        pages = self.dec_sched.page_table[row, : _cdiv(prefix, ps)]
        bad, count = xp.zeros(len(pages), dtype=xp.uint8), xp.zeros(1, dtype=xp.int64)
        self.recv_digest.check(expected=w.digests, mismatch_out=bad, count_out=count, **_blocks(xp, pages, prefix, ps))
        self.checks += 1
        self.blocks += len(pages)
        if int(to_host(count)[0]):
            where = (np.flatnonzero(to_host(bad)) * ps).tolist()
            self.mismatches.append((step, req, where))
            for k in applied:
                self.digest_hits.setdefault(k, []).append(step)
            if not applied:
                self.unattributed += 1
                self.unattributed_lines.append(f"step {step}: request {req}: digest mismatch at positions {where}")

    def _faults(self, step: int, w: Wire, slots: np.ndarray) -> list[int]:
        """Apply the first pending ``pd-*`` fault of each kind that fits this transfer; their indices."""
        inj, kv, n = self.decode.injector, self.decode.kv, len(slots)
        out = []
        for k, f in enumerate(inj.faults):
            if f.kind not in PD_KINDS or f.applied or f.requested_step > step or w.request in inj.taken or n < 4:
                continue
            q = n // 2
            if f.kind == "pd-flip":
                w.k[0, q, 5] ^= 0x04
                hit = (int(slots[q]),)
            elif f.kind == "pd-drop-layer":
                if kv.num_layers < 2:
                    f.needs = "--num-layers >= 2"
                    continue
                w.skip_layer = kv.num_layers - 1
                hit = tuple(int(s) for s in slots)
            else:  # pd-zero
                w.zero_pos = q
                hit = (int(slots[q]),)
            f.applied_step, f.requests, f.slot, f.position, f.slots = step, (w.request,), hit[0], q, hit
            if f.kind == "pd-drop-layer":
                f.slot = int(slots[q])
            inj.taken.add(w.request)
            out.append(k)
        return out

    def summary(self) -> dict:
        return {"transfers": self.transfers, "digest_checks": self.checks, "digest_blocks": self.blocks,
                "digest_mismatches": len(self.mismatches),
                "first_mismatches": [f"step {s}: request {r}: digest mismatch in the blocks at positions {p}"
                                     for s, r, p in self.mismatches[:MAX_SHOWN]],
                "tokens_written": int(self.written.sum())}


def replay_pd(args, console, Progress, columns, series=None) -> tuple[dict, list[str]]:
    """``--pd``'s loop (the options refused with it are in :func:`canary.replay.options.check_arguments`); the
    summary (``replay``'s keys, with ``pd`` and ``canary.prefill``) and the status-check lines."""
    from .replay import _Arrays, _check_pool, _placement, _want

    trace = load_trace(args.trace, args.max_requests)
    mbs = args.max_batch_size
    sched_args = dict(max_batch_size=mbs, page_size=args.page_size, kv_pool_tokens=args.kv_pool_tokens,
                      chunk_size=args.chunk_size, token_budget=args.token_budget,
                      pad_buckets=default_buckets(mbs) if args.pad else (), seed=args.seed)
    _check_pool(sched_args, trace)
    prompts = Trace(trace.name, trace.context_tokens, np.ones_like(trace.generated_tokens))
    pre, dec = Scheduler(prompts, **sched_args), DecodeScheduler(trace, **{**sched_args, "seed": args.seed + 1})
    cap = args.verify_capacity or max(1024, int(args.kv_pool_tokens * 0.6) // 1024 * 1024)
    kind = _placement(args.backend)
    if kind == "numba":
        raise ValueError("kv-canary: --pd: expected CuPy or host arrays for the two instances' KV, got Numba device "
                         "arrays only (CuPy is missing or sees no GPU)")
    arrays = _Arrays(kind)
    device = "cpu" if kind == "host" else arrays.xp.cuda.Device().id
    sample = args.on_overflow == "sample"
    inst = []
    for sched, faults in ((pre, []), (dec, args.inject)):
        r2t = arrays.put(sched.req_to_token)
        inst.append((sched, r2t, ManagerReplay(
            sched, xp=arrays.xp, device=device, backend=args.backend, faults=faults, req_to_token=r2t, lut=None,
            verify_capacity=cap, on_overflow=args.on_overflow, num_layers=args.num_layers,
            layer_dwell=args.layer_dwell)))
    prefill, decode = inst[0][2], inst[1][2]
    prefill.step_of, decode.step_of = [], []
    decode.context = trace.context_tokens + 1  # a request arrives with its prompt and the first sampled token
    pd = PDReplay(prefill, decode, pre, dec)
    console.print(f"kv-canary replay --pd: {len(trace)} requests of trace {trace.name}, backend "
                  f"{decode.group.planner.backend} ({arrays.kind} arrays), verify capacity {cap}", markup=False,
                  highlight=False, soft_wrap=True)
    verify, write, times_us, bs_active, bs_padded, problems = [], [], [], [], [], []
    overflow, interrupted, index = 0, False, 0
    log = None if console.is_terminal else ProgressLog(int(dec.kv_len.sum()), len(trace))
    t_start = time.perf_counter()
    try:
        while not (pre.done and dec.done):
            for req, row, prefix in dec.admit_arrivals():
                pd.arrive(index, req, row, prefix)
            pre._admit()
            step_verify = step_write = 0
            for name, (sched, dev_r2t, session) in zip(("decode", "prefill"), (inst[1], inst[0])):
                rows, prefix, ext = sched._schedule()
                if not len(rows):
                    continue
                sched._allocate(rows, prefix, ext)
                step = sched._step(index, rows, prefix, ext)
                arrays.update(dev_r2t, sched.req_to_token, step.req_pool_indices[: step.num_active])
                inputs = {k: arrays.put(getattr(step, k)) for k in ("req_pool_indices", "prefix_lens",
                                                                   "extend_seq_lens")}
                t0 = time.perf_counter_ns()
                session.step_of.append(index)
                session.before_forward(step, inputs)
                arrays.sync()
                times_us.append((time.perf_counter_ns() - t0) / 1e3)
                got = [int(to_host(getattr(session.plans[0], f))[0]) for f in ("status", "enable", "verify_num_valid")]
                want = _want(step.verify_entries, cap, sample)
                if got != want:
                    problems.append(f"step {index} ({name}): (status, enable, verify_num_valid) = {got}, expected "
                                    f"{want}")
                session.run(step, req_to_token=dev_r2t, lut=None)
                np.add.at(pd.written, step.request_ids, ext)
                if sched is pre:  # prefill done: requests with tokens left to generate go to the decode instance
                    done = (prefix + ext >= sched.kv_len[step.request_ids]) & (trace.generated_tokens[step.request_ids] > 1)
                    for row, req in zip(rows[done].tolist(), step.request_ids[done].tolist()):
                        pd.send(index, req, row)
                        dec.arrivals.append(req)
                sched._advance(rows, ext)
                overflow += step.verify_entries > cap
                step_verify += step.verify_entries
                step_write += step.write_entries
                bs_active.append(step.num_active)
                bs_padded.append(step.bs)
            verify.append(step_verify)
            write.append(step_write)
            index += 1
            if log is not None:
                log.update(index, step_write, _finished(pre, dec, trace))
    except KeyboardInterrupt:
        interrupted = True
    wall = time.perf_counter() - t_start

    def stats(values, qs=(50, 99)):
        out = {f"p{q}": float(np.percentile(values, q)) if values else 0.0 for q in qs}
        out["max"] = float(max(values, default=0))
        return out

    summary = {
        **provenance(), "interrupted": interrupted, "trace": trace.name, "requests": len(trace),
        "requests_finished": _finished(pre, dec, trace), "steps": index, "backend": decode.group.planner.backend,
        "arrays": arrays.kind, "max_batch_size": mbs, "verify_capacity": cap, "on_overflow": args.on_overflow,
        "page_size": args.page_size, "chunk_size": args.chunk_size, "swa_window": 0, "padding": bool(args.pad),
        "seed": args.seed, "offload_tier": 0, "offloads": 0, "restores": 0,
        "batch_size": {"mean_active": float(np.mean(bs_active)) if bs_active else 0.0,
                       "mean_padded": float(np.mean(bs_padded)) if bs_padded else 0.0},
        "verify_entries_per_step": stats(verify), "write_entries_per_step": stats(write),
        "sampled_steps": overflow if sample else 0, "overflow_steps": 0 if sample else overflow,
        "plan_time_us": stats(times_us), "checked_steps": 0, "mismatches": len(problems), "wall_time_s": wall,
        "pd": pd.summary(),
    }
    summary["canary"] = _canary_summary(pd, interrupted)
    return summary, problems


def _finished(pre: Scheduler, dec: DecodeScheduler, trace: Trace) -> int:
    """Requests done: those that finished on the decode instance and those with one output token (the prefill's
    last chunk sampled it: they never go to the decode instance)."""
    ones = trace.generated_tokens == 1
    done_on_prefill = int(ones[: pre.next_request].sum()) - sum(
        1 for r in pre.running if ones[int(pre.row_req[r])])
    return dec.num_finished + done_on_prefill


def _canary_summary(pd: PDReplay, interrupted: bool) -> dict:
    """The decode instance's ``canary`` object, with both instances' violations and the digest's mismatches
    counted, the ``pd-*`` faults detected by the digest too; ``prefill``: the prefill instance's object."""
    c = pd.decode.summary(interrupted=interrupted)
    p = pd.prefill.summary(interrupted=interrupted)
    c["violations"] += p["violations"] + len(pd.mismatches)
    c["unattributed_violations"] += p["unattributed_violations"] + pd.unattributed
    c["first_unattributed"] = (c["first_unattributed"] + [f"prefill {line}" for line in p["first_unattributed"]]
                               + pd.unattributed_lines)[:MAX_SHOWN]
    for k, f in enumerate(c["faults"]):
        steps = pd.digest_hits.get(k, [])
        if not steps:
            continue
        first = min(steps) if f["first_violation_step"] is None else min(min(steps), f["first_violation_step"])
        if f["first_violation_step"] is None or first < f["first_violation_step"]:
            f["kernels"], f["reasons"] = ["digest"], ["DIGEST"]
        elif first == min(steps):
            f["kernels"] = ["digest"] + f["kernels"]
            f["reasons"] = ["DIGEST"] + f["reasons"]
        f["first_violation_step"] = first
        f["steps_to_detection"] = first - f["applied_step"]
        f["detected"] = True
        f["violations"] += len(steps)
        f["all_reasons"] = ["DIGEST"] + f["all_reasons"]
    if c["faults"]:
        c["failed"] = not all(f["detected"] for f in c["faults"])
    else:
        c["failed"] = c["violations"] > 0
    c["prefill"] = {key: v for key, v in p.items() if key != "faults"}
    return c
