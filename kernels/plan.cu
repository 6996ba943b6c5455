// kv-canary planning kernels (SPEC 3.2, 3.4), compiled by NVRTC through CuPy. Numba twin: plan_numba.py.
//
// Small batches (bs <= FUSED_MAX_BS) take ONE launch, canary_plan_fused_*: every block scans the rows itself
// (a few KB from L2), keeps the row offsets in shared memory, then emits its share of the verify entries;
// block 0 also writes the write side. Larger batches take two launches: canary_plan_rows_* (one block: the
// scans, seeds, row flags into scratch) and canary_plan_entries_* (entries, rows found in the scratch scan).
// With a LUT, the last block to finish composes status / enable / verify_num_valid and re-arms the scratch
// counters, so each launch leaves the scratch as it found it (CUDA-graph replays stay correct). A sampling
// planner's fused grid has one extra block that moves the sampling cursors (fused_sampled); its two-pass rows
// launch has side blocks that build a sampled step's table on other SMs while block 0 scans (side_rows; the
// entries kernel moves the cursors), and for huge batch capacities block 0 builds the table after its scan.
// Grids are sized from the capacities (verify_capacity, write_req_capacity) and the device, never from data: a
// captured graph is valid for any later input.
// Specialized at compile time only on what changes the code path: HAS_LUT, HAS_POOL, CANARY_PADDING_NEG (below), and
// FORM, the index form
// (SPEC 3.8: req_to_token, a block table, a page list; plan_index.cuh). FORM is a template parameter, not a
// runtime switch, so that req_to_token's kernels are the very code they were before the other forms existed (no
// branch, no register, no division added to its entries), and one module is compiled per form
// (CANARY_PLAN_FORM, given by the host: the forms an engine never uses cost it no compile time). 64-bit indices.
//
// The constants, sentinels and PlanParams come from canary_constants.cuh (generated from canary/errors.py and
// canary/contract/plan_layout.py); the device code is split by job into the plan_*.cuh headers, included below in
// the order they depend on each other (canary/backends/sources.py inlines them); this file holds the entry points.

#include "canary_constants.cuh"
#include "canary_ints.cuh"

#define FUSED_BATCH (FUSED_MAX_BS / ENTRY_THREADS)  // the fused scan: every row in one batch, no more registers
static_assert(FUSED_MAX_BS % ENTRY_THREADS == 0, "sample_rows_at_once: every fused row in one batch");

#ifndef CANARY_PLAN_FORM
#define CANARY_PLAN_FORM CANARY_FORM_TOKENS
#endif
// The planner's padding_slot (SPEC 3.2, "No reserved slot"): 0 (slot 0 is padding; the code it always was) or 1 for
// padding_slot = -1 (slot 0 is real, a negative slot marks padding). A define like CANARY_PLAN_FORM, given by the host
// (one module each), so that the default's kernels are unchanged and the mode costs no argument or register.
#ifndef CANARY_PADDING_NEG
#define CANARY_PADDING_NEG 0
#endif

#include "plan_index.cuh"
#include "plan_rows.cuh"
#include "plan_sampling.cuh"
#include "plan_entries.cuh"
#include "plan_status.cuh"

// A sampled step of the fused launch. Every block reads the cursors (rank_rows) and the cursors may move only
// once all have. A sampling planner's fused grid has one block more than its entries need (plan_layout.py
// fused_grid): that last block emits nothing, waits until every other block has counted itself in (after its
// reads, without waiting for an answer), and moves the cursors with all its threads. No emitting warp waits for
// anything, so the update is off the plan's path (run 42: one warp of an emitting block moving them cost 1.9 us
// of a bs=256 step). The wait is a spin on co-resident blocks: the grid fits on the device at once, and the
// other blocks never wait for this one, so they always finish.
// CAN_BAD: a launch that can find a bad slot past the row scan (a LUT, or a paged form's negative block entry) ends
// in finalize; without, the row scan alone decides the status.
template <bool HAS_LUT, bool HAS_POOL, int FORM>
__device__ __forceinline__ void fused_sampled(const PlanParams& p, RowTable t, int row_flags, i64 total, int bad) {
    constexpr bool CAN_BAD = HAS_LUT || FORM != CANARY_FORM_TOKENS;
    i64 head_raw;
    const i64 requests = sample_rows_at_once<ENTRY_THREADS, FUSED_BATCH, FORM>(p, t, total, head_raw);  // reads done
    unsigned long long* readers = reinterpret_cast<unsigned long long*>(p.scratch) + SCRATCH_READERS;
    const i64 emitters = (i64)gridDim.x - 1;
    if (blockIdx.x == emitters) {
        if (threadIdx.x == 0) {
            while (atomicAdd(readers, 0ull) < (unsigned long long)emitters) __nanosleep(32);
            __threadfence();  // acquire: the emitters' cursor reads precede this block's cursor stores
            *readers = 0;  // every other block has been counted: re-armed for the next launch
        }
        __syncthreads();
        update_cursors(p, t, requests);
    } else {
        if (threadIdx.x == 0) {
            __threadfence();  // release: this block's cursor reads (ordered by sample_rows_at_once's last barrier)
            atomicAdd(readers, 1ull);
        }
        bad |= emit_entries<HAS_LUT, HAS_POOL, true, FORM>(p, t, RowSamples{nullptr, 0, 0}, p.verify_capacity,
                                                           emitters);
    }
    if (CAN_BAD) finalize(p, row_flags, total, bad);
    else if (blockIdx.x == 0 && threadIdx.x == 0) write_status(p, row_flags, total);
}

template <bool HAS_LUT, bool HAS_POOL, int FORM>
__device__ __forceinline__ void plan_fused(const PlanParams& p) {
    constexpr bool CAN_BAD = HAS_LUT || FORM != CANARY_FORM_TOKENS;
    __shared__ i64 s_off[FUSED_MAX_BS + 1], s_base[FUSED_MAX_BS], s_pdelta[FUSED_MAX_BS];
    __shared__ i64 s_pbase[HAS_POOL ? FUSED_MAX_BS : 1], s_vlim[HAS_POOL ? FUSED_MAX_BS : 1];
    __shared__ i64 s_lo[FUSED_MAX_BS], s_len[FUSED_MAX_BS], s_rank[FUSED_MAX_BS];
    const RowTable t = {s_off, s_base, s_pdelta, s_pbase, s_vlim, s_lo, s_len, s_rank};
    int row_flags, seed_bad;
    const i64 total = blockIdx.x == 0
        ? scan_rows<ENTRY_THREADS, FUSED_BATCH, HAS_LUT, HAS_POOL, true, FORM>(p, t, row_flags, seed_bad)
        : scan_rows<ENTRY_THREADS, FUSED_BATCH, HAS_LUT, HAS_POOL, false, FORM>(p, t, row_flags, seed_bad);
    if (sampling(p, row_flags, total)) {
        fused_sampled<HAS_LUT, HAS_POOL, FORM>(p, t, row_flags, total, seed_bad);
        return;
    }
    // Without a LUT (and req_to_token), the row scan alone decides everything: block 0 writes it.
    if (!CAN_BAD && blockIdx.x == 0 && threadIdx.x == 0) write_status(p, row_flags, total);
    int bad = seed_bad;
    const bool emits = total <= p.verify_capacity && !(row_flags & CANARY_NO_ENTRIES);
    if (emits) bad |= emit_entries<HAS_LUT, HAS_POOL, false, FORM>(p, t, RowSamples{nullptr, 0, 0}, total, gridDim.x);
    if (CAN_BAD) finalize_fused(p, row_flags, total, bad, emits);
}

#include "plan_side.cuh"

// One block: the scans, and for a sampled step the sampled table and the cursors' reset (this block is the only
// reader of the cursors, so it may reset them once its threads have read them: rank_rows ends on a barrier).
// The entries kernel advances them, a row per thread over its grid: on one block that half was a chain of
// dependent round trips, rows deep per thread (run 44: a bs=4096 sampled step 44.7 us against 24.2 for a full
// plan of its capacity).
template <bool HAS_LUT, bool HAS_POOL, int FORM>
__device__ __forceinline__ void plan_rows(const PlanParams& p) {
    constexpr bool CAN_BAD = HAS_LUT || FORM != CANARY_FORM_TOKENS;
    if (blockIdx.x > 0) {
        side_rows<HAS_POOL, FORM>(p);
        return;
    }
    const RowTable t = global_table(p);
    int row_flags, seed_bad;
    const i64 total = scan_rows<ROWS_THREADS, ROW_BATCH, HAS_LUT, HAS_POOL, true, FORM>(p, t, row_flags, seed_bad);
    row_flags |= seed_bad ? CANARY_BAD_SLOT : 0;
    if (gridDim.x == 1 && sampling(p, row_flags, total)) {  // no side blocks: this block builds the table
        i64 head_raw;
        const i64 requests = rank_rows<ROWS_THREADS, ROW_BATCH>(p, t, head_raw);
        sample_rows<ROWS_THREADS, ROW_BATCH, FORM>(p, t, total, requests, head_raw);
    }
    if (threadIdx.x == 0) {
        p.scratch[SCRATCH_ROW_FLAGS] = row_flags;
        p.scratch[SCRATCH_TOTAL] = total;
        p.scratch[SCRATCH_SIDE] = (i64)gridDim.x - 1;
        if (!CAN_BAD) write_status(p, row_flags, total);
    }
}

template <bool HAS_LUT, bool HAS_POOL, int FORM>
__device__ __forceinline__ void plan_entries(const PlanParams& p) {
    constexpr bool CAN_BAD = HAS_LUT || FORM != CANARY_FORM_TOKENS;
    __shared__ i64 s_samples[ROW_SAMPLES + 1];
    const int row_flags = (int)p.scratch[SCRATCH_ROW_FLAGS];
    const i64 total = p.scratch[SCRATCH_TOTAL];
    const bool sampled = sampling(p, row_flags, total), side = p.scratch[SCRATCH_SIDE] != 0;
    const i64 emitted = sampled ? p.verify_capacity : total;
    const RowTable t = sampled && side ? side_table(p) : global_table(p);
    const i64 step = max((p.bs + ROW_SAMPLES - 1) / ROW_SAMPLES, (i64)1), count = (p.bs + step - 1) / step;
    for (i64 j = threadIdx.x; j < count; j += blockDim.x) s_samples[j] = t.off[j * step];
    if (threadIdx.x == 0) s_samples[count] = emitted;
    __syncthreads();
    int bad = 0;
    if (sampled) {
        bad = emit_entries<HAS_LUT, HAS_POOL, true, FORM>(p, t, RowSamples{s_samples, step, count}, emitted,
                                                          gridDim.x);
        // The cursors' second half, after the entries, off their path: nothing in this launch reads a cursor, so
        // no block waits for another. Side blocks merged the next cursors; without them, plan_rows reset them.
        if (side)
            move_cursors(p, t);
        else
            for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < p.bs; r += (i64)gridDim.x * blockDim.x)
                advance_cursor(p, t, r);
    } else if (total <= p.verify_capacity && !(row_flags & CANARY_NO_ENTRIES))
        bad = emit_entries<HAS_LUT, HAS_POOL, false, FORM>(p, t, RowSamples{s_samples, step, count}, emitted,
                                                           gridDim.x);
    if (CAN_BAD) finalize(p, row_flags, total, bad);
}

// One module per form (CANARY_PLAN_FORM): req_to_token's kernels keep their names, the other forms' end in
// _blocks / _pages (canary/backends/cupy/plan.py kernel_name).
#define CANARY_SPECIALIZE(SUFFIX, HAS_LUT, HAS_POOL, FORM)                                                     \
    extern "C" __global__ void __launch_bounds__(ENTRY_THREADS, FUSED_MIN_BLOCKS) canary_plan_fused_##SUFFIX(const PlanParams p) { \
        plan_fused<HAS_LUT, HAS_POOL, FORM>(p);                                                                \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) canary_plan_rows_##SUFFIX(const PlanParams p) {  \
        plan_rows<HAS_LUT, HAS_POOL, FORM>(p);                                                                 \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ENTRY_THREADS, ENTRY_MIN_BLOCKS) canary_plan_entries_##SUFFIX(const PlanParams p) { \
        plan_entries<HAS_LUT, HAS_POOL, FORM>(p);                                                              \
    }

#if CANARY_PLAN_FORM == CANARY_FORM_TOKENS
CANARY_SPECIALIZE(lut0_pool0, false, false, CANARY_FORM_TOKENS)
CANARY_SPECIALIZE(lut1_pool0, true, false, CANARY_FORM_TOKENS)
CANARY_SPECIALIZE(lut0_pool1, false, true, CANARY_FORM_TOKENS)
CANARY_SPECIALIZE(lut1_pool1, true, true, CANARY_FORM_TOKENS)
#elif CANARY_PLAN_FORM == CANARY_FORM_BLOCKS
CANARY_SPECIALIZE(lut0_pool0_blocks, false, false, CANARY_FORM_BLOCKS)
CANARY_SPECIALIZE(lut1_pool0_blocks, true, false, CANARY_FORM_BLOCKS)
CANARY_SPECIALIZE(lut0_pool1_blocks, false, true, CANARY_FORM_BLOCKS)
CANARY_SPECIALIZE(lut1_pool1_blocks, true, true, CANARY_FORM_BLOCKS)
#elif CANARY_PLAN_FORM == CANARY_FORM_PAGES
CANARY_SPECIALIZE(lut0_pool0_pages, false, false, CANARY_FORM_PAGES)
CANARY_SPECIALIZE(lut1_pool0_pages, true, false, CANARY_FORM_PAGES)
CANARY_SPECIALIZE(lut0_pool1_pages, false, true, CANARY_FORM_PAGES)
CANARY_SPECIALIZE(lut1_pool1_pages, true, true, CANARY_FORM_PAGES)
#else
#error "CANARY_PLAN_FORM: expected CANARY_FORM_TOKENS, CANARY_FORM_BLOCKS or CANARY_FORM_PAGES"
#endif
