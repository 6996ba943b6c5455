// Part of kernels/plan.cu, which includes it in order after canary_constants.cuh (not a standalone header):
// the verify entries: the row search and emit_entries.

// The row holding entry i, given off[lo] <= i < off[hi]: the last r with off[r] <= i (empty rows are
// skipped: the last of equal offsets wins).
__device__ __forceinline__ i64 owning_row(const i64* off, i64 lo, i64 hi, i64 i) {
    while (hi - lo > 1) {
        const i64 mid = (lo + hi) >> 1;
        if (off[mid] <= i) lo = mid; else hi = mid;
    }
    return lo;
}

// The verify entries of this block. Each pass of a warp covers ITEMS * 32 consecutive entries (lane-major
// inside each of the ITEMS groups, so stores stay coalesced); all loads of a pass are issued before any
// store. Lanes 0 and 1 find the rows of the pass's first and last entry; every lane then searches only
// between them (no step at all when the pass lies in one row, as in decode). A predecessor in the same row is the slot the lane to the left just translated (warp shuffle), so
// only row heads and lane 0 read req_to_token twice. Returns whether a translated slot fell outside the LUT.
// Two-pass: every step-th row offset in shared memory, so that a row search is a short search there, then a
// search of at most `step` rows of the global table.
struct RowSamples {
    const i64* off;  // nullptr: the table is in shared memory already (fused), search it whole
    i64 step;
    i64 count;
};

__device__ __forceinline__ i64 find_row(const RowTable& t, const RowSamples& s, i64 bs, i64 i) {
    if (!s.off) return owning_row(t.off, 0, bs, i);
    const i64 j = owning_row(s.off, 0, s.count, i);  // s.off[j] <= i; s.off[count] is the total
    return owning_row(t.off, j * s.step, min((j + 1) * s.step, bs), i);
}

// SAMPLED is a template flag so that a plan that verifies everything runs the code it ran before sampling; FORM
// (plan_index.cuh) likewise, so that req_to_token's plan is the code it was before the other forms.
template <bool HAS_LUT, bool HAS_POOL, bool SAMPLED, int FORM>
__device__ __forceinline__ int emit_entries(const PlanParams& p, RowTable t, RowSamples samples, i64 total,
                                            i64 blocks) {
    int bad = 0;
    const double inv_ps = FORM != CANARY_FORM_TOKENS ? 1.0 / (double)p.page_size : 0.0;
    const int lane = threadIdx.x & 31;
    const i64 warps = blocks * (blockDim.x >> 5);
    const i64 warp = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    for (i64 first = warp * ENTRY_CHUNK; first < total; first += warps * ENTRY_CHUNK) {
        const i64 last = min(first + ENTRY_CHUNK, total) - 1;
        i64 edge = 0;
        if (lane < 2) edge = find_row(t, samples, p.bs, lane == 0 ? first : last);
        const i64 r_lo = __shfl_sync(0xffffffffu, edge, 0), r_hi = __shfl_sync(0xffffffffu, edge, 1);
        i64 idx[ITEMS], pos[ITEMS], raw[ITEMS], r_of[ITEMS];
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            const i64 i = first + k * 32 + lane;
            const i64 r = i < total ? owning_row(t.off, r_lo, r_hi + 1, i) : r_lo;
            r_of[k] = r;
            idx[k] = t.base[r] + i;
            pos[k] = i + t.pdelta[r];
            if (SAMPLED && pos[k] >= t.lo[r] + t.len[r]) {  // the run wrapped to the window's start
                pos[k] -= t.len[r];
                idx[k] -= t.len[r];
            }
        }
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) raw[k] = first + k * 32 + lane < total ? load_raw<FORM>(p, idx[k], inv_ps, bad) : 0;
        i64 tok[ITEMS];
        if (HAS_POOL) {
#pragma unroll
            for (int k = 0; k < ITEMS; ++k) {
                const i64 i = first + k * 32 + lane;
                tok[k] = -1;
                const i64 col = pos[k] + p.token_offset;
                if (i < total && col >= 0 && col < t.vlim[r_of[k]]) tok[k] = (i64)p.pool[t.pbase[r_of[k]] + col];
            }
        }
        i64 slot[ITEMS];
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) slot[k] = first + k * 32 + lane < total ? translate<HAS_LUT>(raw[k], p.lut, p.lut_len, bad) : 0;
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            const i64 i = first + k * 32 + lane;
            const i64 left = __shfl_up_sync(0xffffffffu, slot[k], 1);
            if (i >= total) continue;
            // Same row as the lane to the left? (the window does not reset the chain: a window head keeps
            // its real predecessor, read below)
            const bool inside = lane > 0 && i > t.off[r_of[k]] && !(SAMPLED && pos[k] == t.lo[r_of[k]]);
            i64 prev = -1;
            if (inside) prev = left;
            else if (pos[k] > 0) prev = translate<HAS_LUT>(load_raw<FORM>(p, idx[k] - 1, inv_ps, bad), p.lut, p.lut_len, bad);
            // The sentinel only in the stored slot: the lane to the right took slot[k] as its predecessor,
            // which keeps the plain translation (an evicted predecessor skips the chain check). padding_slot = -1:
            // any negative translation is no slot, and a predecessor that is none is MISSING_SLOT (verify's "no
            // link"; -1 would read as position 0's anchor).
            if (CANARY_PADDING_NEG && pos[k] > 0 && prev < 0) prev = CANARY_MISSING_SLOT;
            if (CANARY_PADDING_NEG) p.slots[i] = slot[k] < 0 ? CANARY_MISSING_SLOT : slot[k];
            else p.slots[i] = (raw[k] == 0 || (HAS_LUT && raw[k] > 0 && slot[k] == 0)) ? CANARY_MISSING_SLOT : slot[k];
            p.prevs[i] = prev;
            p.positions[i] = pos[k];
            p.expected[i] = HAS_POOL ? tok[k] : -1;
        }
    }
    return bad;
}
