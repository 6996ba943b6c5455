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
// The blocks of an entries grid that own entries (emit: entries are emitted), at least 1: only they, and block 0
// (the seeds' bad bit), can find a bad slot, so only they finalize: a small plan's status then waits for one
// block's arrival, not for the whole grid's atomics in turn (about 2 us of a 4 us plan with a block table, issue
// 26). Block b owns entries iff its first warp's first chunk (emit_entries' grid stride) starts below total.
__device__ __forceinline__ i64 entry_owners(i64 total, bool emit) {
    const i64 per_block = (i64)(blockDim.x >> 5) * ENTRY_CHUNK;
    return emit ? min((i64)gridDim.x, max((i64)1, (total + per_block - 1) / per_block)) : 1;
}

// blocks: how many blocks call it (the first ones of the grid; gridDim.x unless the caller knows fewer can find a bad
// slot).
__device__ __forceinline__ void finalize(const PlanParams& p, int row_flags, i64 total, int bad_slot,
                                         i64 blocks) {
    const int any_bad = __syncthreads_or(bad_slot);  // also: every thread of the block has finished its stores
    if (threadIdx.x == 0) {
        u64* scratch = reinterpret_cast<u64*>(p.scratch);
        if (any_bad) atomicOr(scratch + SCRATCH_BAD_SLOT, (u64)CANARY_BAD_SLOT);
        __threadfence();
        if (atomicAdd(scratch + SCRATCH_DONE, 1ull) == (u64)blocks - 1) {
            __threadfence();
            write_status(p, row_flags | (int)atomicExch(scratch + SCRATCH_BAD_SLOT, 0ull), total);
            scratch[SCRATCH_DONE] = 0;
        }
    }
}
