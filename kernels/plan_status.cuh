// Part of kernels/plan.cu, which includes it in order after canary_constants.cuh (not a standalone header):
// the status word, enable and verify_num_valid (write_status), the sampling decision, and finalize, where the
// last block of a LUT launch composes them and re-arms the scratch.

__device__ __forceinline__ void write_status(const PlanParams& p, int st, i64 total) {
    if (total > p.verify_capacity) st |= p.sample ? CANARY_SAMPLED : CANARY_OVERFLOW;
    *p.status = st;
    *p.enable = (st & ~CANARY_SAMPLED) == 0 ? 1 : 0;
    *p.num_valid = (int)(total < p.verify_capacity ? total : p.verify_capacity);
}

// A sampled step's rows: sample on, over the capacity, and every row trusted (SPEC 3.7).
__device__ __forceinline__ bool sampling(const PlanParams& p, int row_flags, i64 total) {
    return p.sample && total > p.verify_capacity && !(row_flags & CANARY_NO_ENTRIES);
}

// With a LUT, any block may find a BAD_SLOT: every block calls this once, last thing, and the last block to
// arrive composes the status and re-arms the scratch words. (Without a LUT the row scan alone decides the
// status, and one block writes it: no atomics.)
__device__ __forceinline__ void finalize(const PlanParams& p, int row_flags, i64 total, int bad_slot) {
    const int any_bad = __syncthreads_or(bad_slot);  // also: every thread of the block has finished its stores
    if (threadIdx.x == 0) {
        u64* scratch = reinterpret_cast<u64*>(p.scratch);
        if (any_bad) atomicOr(scratch + SCRATCH_BAD_SLOT, (u64)CANARY_BAD_SLOT);
        __threadfence();
        if (atomicAdd(scratch + SCRATCH_DONE, 1ull) == (u64)gridDim.x - 1) {
            __threadfence();
            write_status(p, row_flags | (int)atomicExch(scratch + SCRATCH_BAD_SLOT, 0ull), total);
            scratch[SCRATCH_DONE] = 0;
        }
    }
}
