"""CuPy backend: the CUDA C kernels of ``kernels/plan.cu``, compiled by NVRTC through ``cupy.RawModule``.

One compile per process and index form (the (LUT, pool) specializations of a form in one module, compiled with
``CANARY_PLAN_FORM``; CuPy also caches it on disk), one module load per device. ``bind`` packs every launch
argument into one by-value ``PlanParams`` struct (uint64 words in a NumPy array whose address CuPy hands to
``cuLaunchKernel``) and allocates the scratch; ``warmup`` (or the first call) compiles, loads and fixes the grids
from the capacities and the device. A call then writes seven words (the per-step pointers, ``bs`` and the arrays'
widths; a step that passes its own index arrays, SPEC 3.8, the index's words too) and issues one launch
(``bs <= FUSED_MAX_BS``) or two, on the caller's stream: no allocation, compilation, module load or host sync, so the call can be captured
in a CUDA graph.
"""
from __future__ import annotations

from ..args import DEFAULT_LAUNCH, KVIndex, LaunchConfig, StaticArgs, StepArgs
from ...contract.kvindex import FORM_BLOCKS, FORM_PAGES, FORM_TOKENS
from ...contract.plan_layout import (ENTRY_THREADS, FUSED_MAX_BS, PARAM_FIELDS, ROWS_THREADS, entry_grid, fused_grid, rows_grid,
                           scratch_words)
from . import Params, Streams, cupy, load_functions

NAME = "cupy"
ON_DEVICE = True

_STEP_WORDS = tuple(PARAM_FIELDS.index(n) for n in ("req_pool_indices", "prefix_lens", "extend_seq_lens",
                                                     "valid_lens", "bs", "expected_token_pool_indices",
                                                     "step_wide"))


_FORM_SUFFIX = {FORM_TOKENS: "", FORM_BLOCKS: "_blocks", FORM_PAGES: "_pages"}


def suffix(has_lut: bool, has_pool: bool, form: int = FORM_TOKENS) -> str:
    """plan.cu's specialization suffix; req_to_token's kernels keep the names they had before the other forms."""
    return f"lut{int(has_lut)}_pool{int(has_pool)}{_FORM_SUFFIX[form]}"


def index_words(index: KVIndex) -> dict:
    """The PlanParams words of an index (SPEC 3.8): its int32 table, key stride and bounds, a page list's offsets.
    A per-step index rewrites them (and the bound one's are written back on the next step without one)."""
    ptr = index.kv_indptr
    return dict(req_to_token=index.table.ptr, r2t_row_stride=index.key_stride, max_seq_len=index.max_seq_len,
                page_size=index.page_size, kv_indptr=0 if ptr is None else ptr.ptr,
                kv_indptr_wide=int(ptr is not None and ptr.dtype.itemsize == 8),
                kv_nnz=index.table.shape[0] if index.form == FORM_PAGES else 0, table_wide=index.table_wide)


class Bound:
    def __init__(self, static: StaticArgs, launch: LaunchConfig = DEFAULT_LAUNCH):
        s = static
        self.device_id = s.device_id
        self._index = index = s.index
        sfx = suffix(s.full_to_swa_index_mapping is not None, s.req_to_verify_expected_tokens is not None,
                     index.form)
        self._names = tuple(f"canary_plan_{kernel}_{sfx}" for kernel in ("fused", "rows", "entries"))
        self._defines = (() if index.form == FORM_TOKENS else (("CANARY_PLAN_FORM", str(index.form)),)) + (
            (("CANARY_PADDING_NEG", "1"),) if s.padding_slot == -1 else ())  # SPEC 3.2 "No reserved slot"
        with cupy.cuda.Device(self.device_id):
            # Head words re-armed by every launch, the two-pass row tables (bs <= R), the next cursors.
            self.scratch = cupy.zeros(scratch_words(s.write_req_capacity, s.cursor_rows), dtype=cupy.int64)
        lut, pool = s.full_to_swa_index_mapping, s.req_to_verify_expected_tokens
        values = dict(
            rp_bound=s.max_reqs, pool_rows=s.pool_rows,
            lut=0 if lut is None else lut.ptr, lut_len=0 if lut is None else lut.shape[0],
            pool=0 if pool is None else pool.ptr, pool_row_stride=0 if pool is None else pool.strides[0],
            pool_cols=0 if pool is None else pool.shape[1], token_offset=s.kv_token_id_vs_position_offset,
            window=s.swa_window_size, padding_rows_carry_tokens=int(s.padding_rows_carry_tokens),
            verify_capacity=s.verify_capacity, write_req_capacity=s.write_req_capacity,
            slots=s.verify_slot_indices.ptr, expected=s.verify_expected_tokens.ptr,
            positions=s.verify_expected_positions.ptr, prevs=s.verify_prev_slot_indices.ptr,
            num_valid=s.verify_num_valid.ptr, enable=s.enable.ptr, status=s.status.ptr,
            write_offsets=s.write_offsets.ptr, seeds=s.write_seed_slot_indices.ptr,
            write_num_valid_reqs=s.write_num_valid_reqs.ptr, scratch=self.scratch.data.ptr,
            cursors=0 if s.verify_cursors is None else s.verify_cursors.ptr, sample=int(s.sample),
            **index_words(index),
        )
        # The struct's bytes, word by word: a call rewrites the seven per-step words and costs no argument
        # conversion at all.
        self._params = Params(PARAM_FIELDS, values)
        self._words, self._args = self._params.words, self._params.args
        self.static = static  # also keeps the caller's arrays alive while their pointers sit in the params
        self._streams = Streams()
        self._fns = None
        self._last = None  # the StepArgs whose words are in the params
        self._words_index = index  # the KVIndex whose words are in the params (a step's own, or the bound one)
        self.fused_max_bs = FUSED_MAX_BS if launch.fused_max_bs is None else min(launch.fused_max_bs, FUSED_MAX_BS)
        self._side_blocks = bool(launch.side_blocks)

    def warmup(self) -> None:
        """Compile (once per process) and load the module on this device; later launches only launch."""
        if self._fns is None:
            fns, (fused_per_sm, rows_per_sm, entries_per_sm), sms = load_functions(
                self.device_id, "plan", tuple(zip(self._names, (ENTRY_THREADS, ROWS_THREADS, ENTRY_THREADS))),
                self._defines)
            cap = self.static.verify_capacity
            self._grids = (
                (fused_grid(cap, sms, fused_per_sm, self.static.sample),),
                (entry_grid(cap, sms, entries_per_sm),),
                (rows_grid(self.static.write_req_capacity, sms, rows_per_sm,
                           self.static.sample and self._side_blocks),),
            )
            self._fns = fns

    def forget_step(self) -> None:
        """Drop the last step (its arrays): a one-shot call's cached launcher keeps no caller array alive. The
        next launch rewrites the per-step words."""
        self._last = None
        if self._words_index is not self._index:
            self._words_index = None  # a step's own index: its views (and arrays) are not kept either

    def launch(self, step: StepArgs, stream: int) -> None:
        st = self._streams.get(stream) or self._streams.get_stream(stream)
        if step is not self._last:  # the words of the previous launch stay in place: a repeated step skips this
            w, i = self._words, _STEP_WORDS
            w[i[0]] = step.req_pool_indices.ptr
            w[i[1]] = step.prefix_lens.ptr
            w[i[2]] = step.extend_seq_lens.ptr
            w[i[3]] = 0 if step.valid_lens is None else step.valid_lens.ptr
            w[i[4]] = step.bs
            w[i[5]] = 0 if step.pool_indices is None else step.pool_indices.ptr
            w[i[6]] = step.step_wide
            index = self._index if step.index is None else step.index
            if index is not self._words_index:  # a step that passes its own index, or the first after one
                self._params.set(index_words(index))
                self._words_index = index
            self._last = step
        if self._fns is None:
            self.warmup()
        fused, rows, entries = self._fns
        dev = cupy.cuda.runtime.getDevice()
        if dev != self.device_id:
            cupy.cuda.runtime.setDevice(self.device_id)
        try:
            if step.bs <= self.fused_max_bs:
                fused(self._grids[0], (ENTRY_THREADS,), self._args, stream=st)
            else:
                rows(self._grids[2], (ROWS_THREADS,), self._args, stream=st)
                entries(self._grids[1], (ENTRY_THREADS,), self._args, stream=st)
        finally:
            if dev != self.device_id:
                cupy.cuda.runtime.setDevice(dev)


def bind(static: StaticArgs, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(static, launch)
