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

// With a LUT or a paged form, any block may find a BAD_SLOT: every block calls this once, last thing. One atomic a
// block carries both facts: the low 32 bits count the blocks, the high 32 bits the blocks that found a BAD_SLOT, so
// the last block to arrive reads the whole grid's answer from its own atomic's result and composes the status. No
// fence and no second round trip: nothing else crosses blocks here (the entries are read by later launches only).
// A separate BAD_SLOT word (atomicOr, fences, the last block's atomicExch) cost the paged forms about 2 us of
// latency at bs=1 (run 141: block table 7.26 us against req_to_token's 5.12 under Nsight Compute).
// (Without a LUT and with req_to_token the row scan alone decides the status, and one block writes it: no atomics.)
__device__ __forceinline__ void finalize(const PlanParams& p, int row_flags, i64 total, int bad_slot) {
    const int any_bad = __syncthreads_or(bad_slot);
    if (threadIdx.x == 0) {
        u64* scratch = reinterpret_cast<u64*>(p.scratch);
        const u64 old = atomicAdd(scratch + SCRATCH_DONE, 1ull | ((u64)(any_bad != 0) << 32));
        if ((old & 0xffffffffull) == (u64)gridDim.x - 1) {
            const bool bad = any_bad != 0 || (old >> 32) != 0;
            write_status(p, row_flags | (bad ? CANARY_BAD_SLOT : 0), total);
            scratch[SCRATCH_DONE] = 0;
        }
    }
}

// The fused launch's finalize. A plan of at most one block's first pass (ENTRY_CHUNK entries a warp: decode at
// small bs), or none emitted, is emitted by block 0 alone, which also holds the seeds' finding: it knows the grid's
// BAD_SLOT and writes the status itself. Every block knows total (each scanned every row), so all take the same
// branch, and nobody counts into SCRATCH_DONE, which stays 0. Run 147: the bs=1 paged plans 0.16 us faster
// (block table 1.31x -> 1.27x req_to_token's time).
__device__ __forceinline__ void finalize_fused(const PlanParams& p, int row_flags, i64 total, int bad, bool emits) {
    if (emits && total > (i64)ENTRY_CHUNK * (blockDim.x >> 5)) {
        finalize(p, row_flags, total, bad);
        return;
    }
    if (blockIdx.x == 0) {
        const int any_bad = __syncthreads_or(bad);
        if (threadIdx.x == 0) write_status(p, row_flags | (any_bad ? CANARY_BAD_SLOT : 0), total);
    }
}
