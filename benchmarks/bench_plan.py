"""Plan kernels (SPEC 3): build, check and time every plan implementation in one run (docs/performance.md).

    python benchmarks/bench_plan.py [--quick] [--impls cupy,cupy_two_pass,numba,torch] [--dry]
        [--form req_to_token,block_table,page_list | all]

For each workload and implementation: the 10 output buffers of one call, on poisoned outputs, checked byte for
byte against the NumPy reference; then device time per plan in CUDA-graph replay (a graph of ``--sets`` plans
over independent buffer sets, so that one plan's data is not in L2 when its turn comes round) and eager wall
time per call (host overhead included: N calls, one sync). Each figure sits beside its floor (the fewest bytes
over the measured copy bandwidth), SGLang's anchor and its target (docs/performance.md). Every workload's
capacity holds all its entries, so no plan samples (the sampled step: bench_sampled.py).
``--form`` (SPEC 3.8): the index the planner reads, ``req_to_token`` (default), ``block_table`` (the workload's
pages, PAGE tokens each) or ``page_list`` (each batch row's pages, as FlashInfer's kv_indptr / kv_indices), or
several; the other forms' figures are named ``<workload>[<form>]`` (keys ``plan.<workload>.<form>``: the same
targets), each followed by its ratio to the req_to_token figure of the same run when that was measured too
(the target: within 10%). Writes benchmarks/results/plan.json.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import harness

from canary import CanaryPlanner, LaunchConfig, VerifyPlan, WritePlan  # noqa: E402
from canary.backends.reference.plan import plan_arrays  # noqa: E402

FORMS = ("req_to_token", "block_table", "page_list")  # the index forms (SPEC 3.8)
OUTPUTS = (
    "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
    "verify_num_valid", "enable", "status", "write_offsets", "write_seed_slot_indices", "write_num_valid_reqs",
)


@dataclass
class Inputs:
    """One plan's inputs as NumPy arrays."""

    name: str
    req_to_token: np.ndarray
    req_pool_indices: np.ndarray
    prefix_lens: np.ndarray
    extend_seq_lens: np.ndarray
    verify_capacity: int
    lut: np.ndarray | None = None
    swa_window_size: int = 0
    block_table: np.ndarray | None = None  # [rows, pages] the pages of req_to_token's rows (PAGE tokens each)

    @property
    def bs(self) -> int:
        return len(self.req_pool_indices)

    @property
    def entries(self) -> int:
        P = self.prefix_lens[self.req_pool_indices != 0]
        return int((np.minimum(P, self.swa_window_size) if self.swa_window_size else P).sum())

    def min_bytes(self) -> int:
        """Each input read once, each output written once: per entry a 4-byte slot read (its predecessor is the
        previous entry's slot) and 4 int64 stores, plus 8 bytes of LUT per entry; per row 24 bytes read and
        16 written (write offset, seed)."""
        per_entry = 4 + 32 + (8 if self.lut is not None else 0)
        return self.entries * per_entry + self.bs * (24 + 16)

    def index(self, form: str) -> dict[str, np.ndarray | int]:
        """The planner's index keywords in ``form`` (SPEC 3.8), NumPy arrays."""
        if form == "req_to_token":
            return dict(req_to_token=self.req_to_token)
        bt = self.block_table if self.block_table is not None else np.ascontiguousarray(
            self.req_to_token[:, ::PAGE] // PAGE)  # pages of PAGE slots, page-aligned (trace steps)
        if form == "block_table":
            return dict(block_table=bt, page_size=PAGE)
        need = np.where(self.req_pool_indices != 0, -(-(self.prefix_lens + self.extend_seq_lens) // PAGE), 0)
        indptr = np.zeros(self.bs + 1, np.int32)
        indptr[1:] = np.cumsum(need)
        indices = np.concatenate([bt[rp, :n] for rp, n in zip(self.req_pool_indices, need)] + [np.zeros(0, bt.dtype)])
        return dict(kv_indptr=indptr, kv_indices=indices.astype(np.int32), page_size=PAGE)


PAGE = 16  # tokens per KV page, as in the replay's scheduler


def paged_table(rng, rows: int, cols: int) -> tuple[np.ndarray, int, np.ndarray]:
    """A req_to_token whose rows are pages of PAGE consecutive slots drawn from a shuffled pool, as a paged
    allocator hands them out (page 0 reserved: slot 0 is the padding slot). Returns it, the slot count and the
    block table of its pages."""
    pages_per_row = -(-cols // PAGE)
    num_pages = rows * pages_per_row + 1
    pages = rng.permutation(np.arange(1, num_pages, dtype=np.int64)).reshape(rows, pages_per_row)
    j = np.arange(cols)
    table = pages[:, j // PAGE] * PAGE + j % PAGE
    # fancy indexing gave F order
    return np.ascontiguousarray(table, dtype=np.int32), num_pages * PAGE, np.ascontiguousarray(pages, np.int32)


def paged_lut(rng, num_slots: int) -> np.ndarray:
    """full slot -> SWA slot, page for page (a sliding-window pool paged like the full one)."""
    num_pages = num_slots // PAGE
    swa_pages = np.concatenate([[0], rng.permutation(np.arange(1, num_pages, dtype=np.int64))])
    s = np.arange(num_slots, dtype=np.int64)
    return swa_pages[s // PAGE] * PAGE + s % PAGE


def workloads(rng: np.random.Generator, quick: bool, dry: bool = False) -> list[Inputs]:
    """The six workloads of docs/performance.md (``quick``: two of them; ``dry``: the same names, tiny)."""
    def batch(name, bs, p_lo, p_hi, e_lo, e_hi, C, W=0):
        P = rng.integers(p_lo, p_hi + 1, size=bs).astype(np.int64)
        E = rng.integers(e_lo, e_hi + 1, size=bs).astype(np.int64)
        rpi = rng.permutation(np.arange(1, bs + 1)).astype(np.int64)
        r2t, num_slots, bt = paged_table(rng, bs + 1, p_hi + e_hi)
        lut = paged_lut(rng, num_slots) if W else None
        return Inputs(name, r2t, rpi, P, E, C, lut, W, bt)

    if dry:
        return [batch("bs1", 1, 8, 32, 1, 1, C=64), batch("bs8_decode", 8, 16, 64, 1, 1, C=8 * 64),
                batch("bs32_prefill", 4, 0, 32, 1, 16, C=4 * 32), batch("swa_bs256", 4, 16, 64, 1, 1, C=4 * 16, W=16)]
    out = [
        batch("bs1", 1, 64, 256, 1, 1, C=4096),
        batch("bs8_decode", 8, 512, 4096, 1, 1, C=8 * 4096),
        batch("bs256_decode", 256, 512, 4096, 1, 1, C=1 << 20),
        batch("bs32_prefill", 32, 0, 8192, 1, 2048, C=32 * 8192),
        batch("swa_bs256", 256, 4096, 32768, 1, 1, C=256 * 4096, W=4096),
        batch("bs4096", 4096, 256, 1024, 1, 1, C=4096 * 1024),
    ]
    if quick:
        out = [w for w in out if w.name in ("bs1", "bs256_decode")]
    return out


def trace_steps(count: int, requests: int = 300) -> list[Inputs]:
    """Real step shapes: the bundled conversation trace through the scheduler, ``count`` steps spread evenly."""
    from canary.replay.scheduler import Scheduler, default_buckets, load_trace

    sched = Scheduler(load_trace("conv", requests), max_batch_size=64, pad_buckets=default_buckets(64), seed=0)
    steps = []
    for st in sched.steps():
        steps.append(Inputs(f"trace{st.index}", st.req_to_token.copy(), st.req_pool_indices.copy(),
                            st.prefix_lens.copy(), st.extend_seq_lens.copy(), 1 << 17))
    pick = np.linspace(0, len(steps) - 1, count).astype(int)
    return [steps[i] for i in pick]


def reference(inp: Inputs, form: str = "req_to_token") -> dict[str, np.ndarray]:
    out = poisoned(inp)
    plan_arrays(**inp.index(form), lut=inp.lut, pool=None, swa_window_size=inp.swa_window_size,
                token_offset=0, req_pool_indices=inp.req_pool_indices, prefix_lens=inp.prefix_lens,
                extend_seq_lens=inp.extend_seq_lens, valid_lens=None, out=out)
    return out


_INT32 = ("verify_num_valid", "enable", "status", "write_num_valid_reqs")


def poisoned(inp: Inputs) -> dict[str, np.ndarray]:
    """Output buffers filled with a pattern no plan writes, so that unwritten elements show."""
    C, R = inp.verify_capacity, inp.bs
    sizes = dict(write_offsets=R + 1, write_seed_slot_indices=R)
    out = {k: np.full(sizes.get(k, C), 0x5A5A5A5A5A5A5A5A, dtype=np.int64) for k in OUTPUTS if k not in _INT32}
    out.update({k: np.full(1, 0x5A5A5A5A, dtype=np.int32) for k in _INT32})
    return out



class Bound:
    """One implementation bound to its own copy of one workload (``xp``: CuPy, or NumPy for the reference)."""

    def __init__(self, impl: str, inp: Inputs, xp, form: str = "req_to_token"):
        self.impl, self.inp, self.xp = impl, inp, xp
        a = xp.asarray
        self.dev = {k: a(getattr(inp, k)) for k in ("req_to_token", "req_pool_indices", "prefix_lens",
                                                    "extend_seq_lens")}
        index = {k: v if isinstance(v, int) else a(v) for k, v in inp.index(form).items()}
        self.lut = None if inp.lut is None else a(inp.lut)
        self.out = {k: a(v) for k, v in poisoned(inp).items()}
        self.step = {k: self.dev[k] for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens")}
        self.capturable = impl != "torch"  # its host sync sizes the intermediates: no graph
        if impl == "torch":
            import torch

            from torch_planner import torch_plan

            t = {k: torch.from_dlpack(v) for k, v in self.dev.items()}
            to = {k: torch.from_dlpack(v) for k, v in self.out.items()}
            tl = None if self.lut is None else torch.from_dlpack(self.lut)

            def call(stream=None):
                torch_plan(req_pool_indices=t["req_pool_indices"], prefix_lens=t["prefix_lens"],
                           extend_seq_lens=t["extend_seq_lens"], req_to_token=t["req_to_token"],
                           swa_window_size=inp.swa_window_size, full_to_swa_index_mapping=tl, out=to)

            self.call = call
            return
        backend = {"cupy_two_pass": "cupy"}.get(impl, impl)
        two_pass = impl == "cupy_two_pass"  # the scan + per-entry binary search shape of SGLang's planner
        # The cursors are bound (on_overflow="sample", the default) but never read: every capacity holds its
        # workload's entries, so the timings are those of the plain plan.
        self.cursors = xp.zeros(inp.req_to_token.shape[0], dtype=xp.int64)
        self.planner = CanaryPlanner(
            backend=backend, launch_config=LaunchConfig(fused_max_bs=-1 if two_pass else None),
            verify_plan_out=VerifyPlan(**{k: self.out[k] for k in OUTPUTS[:7]}, verify_cursors=self.cursors),
            write_plan_out=WritePlan(**{k: self.out[k] for k in OUTPUTS[7:]}),
            **index, swa_window_size=inp.swa_window_size, full_to_swa_index_mapping=self.lut,
        )
        self.planner.warmup()
        self.call = lambda stream=None: self.planner.plan(**self.step, stream=stream)

    def outputs(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v.get() if hasattr(v, "get") else v) for k, v in self.out.items()}


def check(b: Bound, want: dict[str, np.ndarray], sync) -> str | None:
    """One call on poisoned outputs against the reference's: the first difference, or ``None``."""
    b.call()
    sync()
    got = b.outputs()
    for k in OUTPUTS:
        if got[k].shape != want[k].shape or not np.array_equal(got[k], want[k]):
            bad = np.flatnonzero(got[k] != want[k]) if got[k].shape == want[k].shape else [-1]
            return f"{b.inp.name}: {k} differs (first index {int(bad[0])})"
    return None


def eager_us(bound: list[Bound], calls: int, sync, rounds: int) -> harness.Timing:
    """Wall time per call, host overhead included: ``calls`` calls of each bound plan, one sync."""
    def every():
        for b in bound:
            b.call()
    return harness.wall_time(every, calls=calls, sync=sync, rounds=rounds, per_round=len(bound))


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="two workloads, fewer repeats")
    ap.add_argument("--impls", default="cupy,cupy_two_pass,numba,torch")
    ap.add_argument("--sets", type=int, default=4, help="independent buffer sets per graph (L2 rotation)")
    ap.add_argument("--form", default="req_to_token",
                    help="the index forms to plan over (SPEC 3.8), comma-separated, or 'all'")
    args = ap.parse_args()
    forms = list(FORMS) if args.form == "all" else args.form.split(",")
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        ap.error(f"--form: expected among {', '.join(FORMS)} or 'all', got {unknown[0]!r}")
    bench = harness.Bench("plan", args, "device time per plan: CUDA-graph replay of --sets plans on independent "
                          "buffers, CUDA events around 50 replays, median of 7 rounds; eager: wall time of 200 "
                          "calls (50 past 1M entries) and one sync, median of 5 rounds")
    xp, dry = bench.xp, bench.dry
    sync = (lambda: None) if dry else (lambda: xp.cuda.Device().synchronize())
    impls = ["reference"] if dry else args.impls.split(",")
    rng = np.random.default_rng(2026)
    graph: dict[tuple, float | None] = {}  # (workload, impl, form) -> graph figure, for the forms' ratios
    groups = [[w] for w in workloads(rng, args.quick, dry)]
    groups.append(trace_steps(2, 20) if dry else trace_steps(8 if args.quick else 32))
    for group, form in ((g, f) for g in groups for f in forms):
        base = group[0].name if len(group) == 1 else "trace_mix"
        name = base if form == "req_to_token" else f"{base}[{form}]"
        key = f"plan.{base}" if form == "req_to_token" else f"plan.{base}.{form}"  # the same targets
        entries = sum(w.entries for w in group) / len(group)
        min_bytes = sum(w.min_bytes() for w in group) / len(group)
        wants = [reference(w, form) for w in group]
        for impl in impls:
            if impl == "torch" and form != "req_to_token":
                continue  # the torch planner reads req_to_token only
            sets: list[list[Bound]] = []

            copies = max(1, args.sets if len(group) == 1 else 1)

            def build():
                sets.extend([Bound(impl, w, xp, form) for w in group] for _ in range(copies))

            def checked():
                build()
                problem = next((e for b, want in zip(sets[0], wants) if (e := check(b, want, sync))), None)
                checks.append(problem)
                return problem

            checks: list[str | None] = []
            flat = lambda: [b for s in sets for b in s]  # noqa: E731
            common = dict(key=key, floor=bench.floor_us(min_bytes), impl=impl, bs=group[0].bs,
                          entries=entries, min_bytes=min_bytes, form=form)
            big = entries >= 1e6
            if impl != "torch":
                row = bench.attempt(f"plan {name} {impl} graph", lambda: harness.device_time(
                    lambda s: [b.call(stream=s) for b in flat()], check=checked, dry=dry,
                    rounds=bench.rounds(7), replays=10 if args.quick or dry else 50,
                    calls_per_replay=copies * len(group)), **common)
                graph[(base, impl, form)] = row["value"]
                tokens = graph.get((base, impl, "req_to_token"))
                if form != "req_to_token" and tokens and row["value"] is not None:
                    bench.figure(f"plan {name} {impl} graph / req_to_token", row["value"] / tokens, "x",
                                 impl=impl, form=form)

            def eager():
                if not checks:  # torch: no graph (its host sync sizes the intermediates), so its check is here
                    harness.require(checked)
                return eager_us(flat()[: len(group)], 2 if dry else 20 if args.quick else 50 if big else 200, sync,
                                bench.rounds(5))

            if checks and checks[0]:
                bench.figure(f"plan {name} {impl} eager", None, error=f"check failed: {checks[0]}", impl=impl)
            else:
                bench.attempt(f"plan {name} {impl} eager", eager, **dict(common, key=None, anchor=None))
            sets.clear()
            if not dry:
                xp.get_default_memory_pool().free_all_blocks()
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
