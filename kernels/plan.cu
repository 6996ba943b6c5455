// kv-canary planning kernels (SPEC 3.2, 3.4), compiled by NVRTC through CuPy.
//
// Two launches on the caller's stream, no host sync between them:
//   canary_plan_rows_*     one block: per-row checks, the verify/write exclusive scans, seeds, status.
//   canary_plan_entries_*  a fixed grid (sized from verify_capacity, so CUDA-graph replays stay valid):
//                          one verify entry per thread, its row found in the row scan.
// Specializations are compile-time only on what changes the code path: HAS_LUT and HAS_POOL.
// Every index is 64-bit: pools over 2^31 slots exist.

#define CANARY_OVERFLOW 1
#define CANARY_BAD_REQ_POOL_INDEX 2
#define CANARY_BAD_PREFIX_LEN 4
#define CANARY_BAD_SLOT 8
#define CANARY_BAD_VALID_LEN 16
// Bits that mean the per-row lengths cannot be trusted: no verify entry is written.
#define CANARY_NO_ENTRIES (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN | CANARY_BAD_VALID_LEN)

#define ROWS_THREADS 1024
#define WARPS (ROWS_THREADS / 32)

typedef long long i64;

// T of SPEC 3.2: negative ids pass through; ids past the LUT are reported and become -1.
template <bool HAS_LUT>
__device__ __forceinline__ i64 translate(i64 raw, const i64* __restrict__ lut, i64 lut_len, int* bad) {
    if (!HAS_LUT || raw < 0) return raw;
    if (raw >= lut_len) { *bad = 1; return -1; }
    return lut[raw];
}

struct RowFacts {
    i64 vcount;  // verify entries of the row
    i64 wlen;    // write entries of the row
    int flags;   // status bits raised by the row
};

template <bool HAS_POOL>
__device__ __forceinline__ RowFacts row_facts(i64 r, const i64* __restrict__ rpi, const i64* __restrict__ prefix,
                                              const i64* __restrict__ ext, const i64* __restrict__ valid_lens,
                                              i64 rp_bound, i64 max_seq_len, i64 pool_cols, i64 window) {
    RowFacts f = {0, 0, 0};
    const i64 rp = rpi[r];
    if (rp == 0) return f;  // padding row: its lengths may be stale garbage
    const i64 e = ext[r];
    const i64 p = prefix[r];
    f.wlen = e > 0 ? e : 0;
    if (rp < 0 || rp >= rp_bound) f.flags |= CANARY_BAD_REQ_POOL_INDEX;
    if (p < 0 || p > max_seq_len) f.flags |= CANARY_BAD_PREFIX_LEN;
    if (HAS_POOL && valid_lens[r] > pool_cols) f.flags |= CANARY_BAD_VALID_LEN;
    if (!(f.flags & (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN))) {
        f.vcount = (window > 0 && p > window) ? window : p;
    }
    return f;
}

// Inclusive block-wide scan of two values per thread; returns the exclusive prefixes and the totals.
__device__ __forceinline__ void block_scan2(i64 a, i64 b, i64* excl_a, i64* excl_b, i64* tot_a, i64* tot_b) {
    __shared__ i64 warp_a[WARPS], warp_b[WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 ia = a, ib = b;
    for (int d = 1; d < 32; d <<= 1) {
        const i64 ua = __shfl_up_sync(0xffffffffu, ia, d);
        const i64 ub = __shfl_up_sync(0xffffffffu, ib, d);
        if (lane >= d) { ia += ua; ib += ub; }
    }
    if (lane == 31) { warp_a[warp] = ia; warp_b[warp] = ib; }
    __syncthreads();
    if (warp == 0) {
        i64 wa = warp_a[lane], wb = warp_b[lane];
        for (int d = 1; d < 32; d <<= 1) {
            const i64 ua = __shfl_up_sync(0xffffffffu, wa, d);
            const i64 ub = __shfl_up_sync(0xffffffffu, wb, d);
            if (lane >= d) { wa += ua; wb += ub; }
        }
        warp_a[lane] = wa; warp_b[lane] = wb;
    }
    __syncthreads();
    const i64 base_a = warp ? warp_a[warp - 1] : 0, base_b = warp ? warp_b[warp - 1] : 0;
    *excl_a = base_a + ia - a;
    *excl_b = base_b + ib - b;
    *tot_a = warp_a[WARPS - 1];
    *tot_b = warp_b[WARPS - 1];
}

// Launch: grid 1, block ROWS_THREADS. Thread t owns a contiguous chunk of rows, so any bs fits one block.
template <bool HAS_LUT, bool HAS_POOL>
__device__ __forceinline__ void plan_rows(
        const i64* __restrict__ rpi, const i64* __restrict__ prefix, const i64* __restrict__ ext,
        const i64* __restrict__ valid_lens, const int* __restrict__ r2t, i64 r2t_row_stride, i64 rp_bound,
        i64 max_seq_len, const i64* __restrict__ lut, i64 lut_len, i64 pool_cols, i64 window, i64 bs,
        i64 verify_capacity, i64 write_req_capacity, i64* __restrict__ row_offsets,
        i64* __restrict__ write_offsets, i64* __restrict__ seeds, int* __restrict__ num_valid,
        int* __restrict__ enable, int* __restrict__ status, int* __restrict__ write_num_valid_reqs) {
    __shared__ int s_flags;
    if (threadIdx.x == 0) s_flags = 0;
    const i64 chunk = (bs + ROWS_THREADS - 1) / ROWS_THREADS;
    const i64 lo = min((i64)threadIdx.x * chunk, bs), hi = min(lo + chunk, bs);

    i64 vsum = 0, wsum = 0;
    int flags = 0;
    for (i64 r = lo; r < hi; ++r) {
        const RowFacts f = row_facts<HAS_POOL>(r, rpi, prefix, ext, valid_lens, rp_bound, max_seq_len, pool_cols,
                                                window);
        vsum += f.vcount; wsum += f.wlen; flags |= f.flags;
    }
    i64 voff, woff, vtotal, wtotal;
    block_scan2(vsum, wsum, &voff, &woff, &vtotal, &wtotal);  // its barriers also publish s_flags = 0

    int bad_seed = 0;
    for (i64 r = lo; r < hi; ++r) {
        const RowFacts f = row_facts<HAS_POOL>(r, rpi, prefix, ext, valid_lens, rp_bound, max_seq_len, pool_cols,
                                                window);
        row_offsets[r] = voff;
        write_offsets[r] = woff;
        i64 seed = -1;
        if (f.wlen > 0 && !(f.flags & (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN))) {
            const i64 p = prefix[r];
            if (p > 0) {
                seed = translate<HAS_LUT>((i64)r2t[rpi[r] * r2t_row_stride + (p - 1)], lut, lut_len, &bad_seed);
            }
        }
        seeds[r] = seed;
        voff += f.vcount; woff += f.wlen;
    }
    if (bad_seed) flags |= CANARY_BAD_SLOT;
    if (flags) atomicOr(&s_flags, flags);
    for (i64 r = bs + 1 + threadIdx.x; r <= write_req_capacity; r += ROWS_THREADS) write_offsets[r] = 0;
    __syncthreads();
    if (threadIdx.x == 0) {
        row_offsets[bs] = vtotal;
        write_offsets[bs] = wtotal;
        int st = s_flags;
        if (vtotal > verify_capacity) st |= CANARY_OVERFLOW;
        *status = st;
        *enable = st == 0 ? 1 : 0;
        *num_valid = (int)(vtotal < verify_capacity ? vtotal : verify_capacity);
        *write_num_valid_reqs = (int)bs;
    }
}

// Last row r in [0, bs) with row_offsets[r] <= i: the row whose entries hold i (empty rows are skipped
// because the search takes the last of equal offsets).
__device__ __forceinline__ i64 owning_row(const i64* __restrict__ row_offsets, i64 bs, i64 i) {
    i64 lo = 0, hi = bs;  // invariant: row_offsets[lo] <= i < row_offsets[hi]
    while (hi - lo > 1) {
        const i64 mid = (lo + hi) >> 1;
        if (row_offsets[mid] <= i) lo = mid; else hi = mid;
    }
    return lo;
}

template <bool HAS_LUT, bool HAS_POOL>
__device__ __forceinline__ void plan_entries(
        const i64* __restrict__ rpi, const i64* __restrict__ prefix, const i64* __restrict__ valid_lens,
        const int* __restrict__ r2t, i64 r2t_row_stride, const i64* __restrict__ lut, i64 lut_len,
        const int* __restrict__ pool, i64 pool_row_stride, i64 token_offset, i64 window, i64 bs,
        const i64* __restrict__ row_offsets, i64* __restrict__ slots, i64* __restrict__ expected,
        i64* __restrict__ positions, i64* __restrict__ prevs, int* __restrict__ enable, int* __restrict__ status) {
    if (*status & (CANARY_OVERFLOW | CANARY_NO_ENTRIES)) return;
    const i64 total = row_offsets[bs];
    int bad = 0;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = owning_row(row_offsets, bs, i);
        const i64 p_len = prefix[r];
        const i64 start = (window > 0 && p_len > window) ? p_len - window : 0;
        const i64 pos = start + (i - row_offsets[r]);
        const i64 rp = rpi[r];
        const int* row = r2t + rp * r2t_row_stride;
        slots[i] = translate<HAS_LUT>((i64)row[pos], lut, lut_len, &bad);
        prevs[i] = pos > 0 ? translate<HAS_LUT>((i64)row[pos - 1], lut, lut_len, &bad) : -1;
        positions[i] = pos;
        i64 tok = -1;
        if (HAS_POOL) {
            const i64 col = pos + token_offset;
            if (col >= 0 && col < valid_lens[r]) tok = (i64)pool[rp * pool_row_stride + col];
        }
        expected[i] = tok;
    }
    if (bad) {
        atomicOr(status, CANARY_BAD_SLOT);
        *enable = 0;
    }
}

#define CANARY_SPECIALIZE(SUFFIX, HAS_LUT, HAS_POOL)                                                            \
extern "C" __global__ void __launch_bounds__(ROWS_THREADS) canary_plan_rows_##SUFFIX(                           \
        const i64* rpi, const i64* prefix, const i64* ext, const i64* valid_lens, const int* r2t,                \
        i64 r2t_row_stride, i64 rp_bound, i64 max_seq_len, const i64* lut, i64 lut_len, i64 pool_cols,          \
        i64 window, i64 bs, i64 verify_capacity, i64 write_req_capacity, i64* row_offsets, i64* write_offsets,   \
        i64* seeds, int* num_valid, int* enable, int* status, int* write_num_valid_reqs) {                      \
    plan_rows<HAS_LUT, HAS_POOL>(rpi, prefix, ext, valid_lens, r2t, r2t_row_stride, rp_bound, max_seq_len, lut, \
                                 lut_len, pool_cols, window, bs, verify_capacity, write_req_capacity,           \
                                 row_offsets, write_offsets, seeds, num_valid, enable, status,                  \
                                 write_num_valid_reqs);                                                         \
}                                                                                                               \
extern "C" __global__ void canary_plan_entries_##SUFFIX(                                                        \
        const i64* rpi, const i64* prefix, const i64* valid_lens, const int* r2t, i64 r2t_row_stride,           \
        const i64* lut, i64 lut_len, const int* pool, i64 pool_row_stride, i64 token_offset, i64 window,        \
        i64 bs, const i64* row_offsets, i64* slots, i64* expected, i64* positions, i64* prevs, int* enable,     \
        int* status) {                                                                                          \
    plan_entries<HAS_LUT, HAS_POOL>(rpi, prefix, valid_lens, r2t, r2t_row_stride, lut, lut_len, pool,           \
                                    pool_row_stride, token_offset, window, bs, row_offsets, slots, expected,    \
                                    positions, prevs, enable, status);                                          \
}

CANARY_SPECIALIZE(lut0_pool0, false, false)
CANARY_SPECIALIZE(lut1_pool0, true, false)
CANARY_SPECIALIZE(lut0_pool1, false, true)
CANARY_SPECIALIZE(lut1_pool1, true, true)
