// Part of kernels/plan.cu, which includes it in order after canary_constants.cuh (not a standalone header):
// the row scan. Each row's facts and status bits (row_facts), the row table an entry finds its row in
// (RowTable), the block-wide scan, and scan_rows: offsets, seeds and the write side.

// T of SPEC 3.2: negative ids pass through; ids past the LUT are reported and become -1.
template <bool HAS_LUT>
__device__ __forceinline__ i64 translate(i64 raw, const i64* __restrict__ lut, i64 lut_len, int& bad) {
    if (!HAS_LUT || raw < 0) return raw;
    if (raw >= lut_len) { bad = 1; return -1; }
    return __ldg(lut + raw);
}

struct Row {
    i64 vcount;  // verify entries
    i64 wlen;    // write entries
    i64 len;     // prefix_lens[r] (0 for padding rows, which are not read further)
    i64 rp;      // req_pool_indices[r]
    int flags;   // status bits the row raises
};

// rp, e and len are read for every row (padding rows' lengths may be stale garbage: they are read, never
// trusted); valid_lens and the pool row q only for active rows, which is why they are loaded apart, after rp.
// cap: the positions the row holds (max_seq_len; a page list's row its pages, row_key), key_bad: a page list's
// kv_indptr pair out of order or range (a bad rp's consequences). Constants for req_to_token: the same code.
template <bool HAS_POOL>
__device__ __forceinline__ Row row_facts(const PlanParams& p, i64 rp, i64 e, i64 len, i64 vl, i64 q, i64 cap,
                                         bool key_bad) {
    Row f = {0, 0, 0, 0, 0};
    if (rp == 0) {  // padding row: only its E is ever trusted, and only when its tokens are among the step's
        if (p.padding_rows_carry_tokens && e > 0) {
            if (e > p.max_seq_len) f.flags |= CANARY_BAD_EXTEND_LEN;  // no row holds that many tokens
            else f.wlen = e;
        }
        return f;
    }
    f.rp = rp;
    f.len = len;
    if (rp < 0 || rp >= p.rp_bound) f.flags |= CANARY_BAD_REQ_POOL_INDEX;
    if (HAS_POOL && (q < 0 || q >= p.pool_rows)) f.flags |= CANARY_BAD_REQ_POOL_INDEX;
    if (key_bad) f.flags |= CANARY_BAD_REQ_POOL_INDEX;
    if (len < 0 || len > cap) f.flags |= CANARY_BAD_PREFIX_LEN;
    if (HAS_POOL && vl > p.pool_cols) f.flags |= CANARY_BAD_VALID_LEN;
    // The new tokens must fit the row: e > room, never len + e, which garbage such as 2^62 would wrap. room >= 0,
    // so a negative e (lengths not to be trusted, SPEC 3.4) is the one other case flagged.
    const i64 room = cap - (len < 0 ? 0 : (len > cap ? cap : len));
    if (e < 0 || e > room) f.flags |= CANARY_BAD_EXTEND_LEN;
    else f.wlen = e;
    if (!(f.flags & (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN | CANARY_BAD_EXTEND_LEN)))
        f.vcount = (p.window > 0 && len > p.window) ? p.window : len;
    return f;
}

// What an entry needs of its row, found by one search over off[]. Entry i of row r (off[r] <= i < off[r+1]):
// position = i + pdelta[r], virtual token index (plan_index.cuh) = base[r] + i; with col = position + token_offset, the
// expected-token index is pbase[r] + col, valid while 0 <= col < vlim[r] (compared as the reference does:
// valid_lens may be garbage such as INT64_MIN, and subtracting the offset from it would wrap).
// A sampled step (SPEC 3.7) rewrites off, base and pdelta so that row r's entries start at its run:
// position = i + pdelta[r] wraps once, from lo[r] + len[r] back to lo[r].
struct RowTable {
    i64* off;     // [bs + 1] exclusive scan of the verify counts (sampled: of the takes)
    i64* base;    // key * r2t_row_stride + window_start - off[r]  (sampled: + run; key: row_key)
    i64* pdelta;  // window_start - off[r]                         (sampled: + run)
    i64* pbase;   // q * pool_row_stride                            (HAS_POOL)
    i64* vlim;    // valid_lens[r]                                  (HAS_POOL)
    i64* lo;      // window_start
    i64* len;     // verify count of the row (its window length)
    i64* rank;    // rank_rows: rows with entries before r; a sampled table: the row's req_pool_indices
                  // (side_rows: 0 for a row that takes no entries)
};

// Exclusive block-wide scan of N int64 per thread (warp shuffles, then one warp over the warp totals).
template <int THREADS, int N>
__device__ __forceinline__ void block_scan(const i64 (&v)[N], i64 (&excl)[N], i64 (&tot)[N]) {
    constexpr int WARPS = THREADS / 32;
    __shared__ i64 warp_sum[N][WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 in[N];
#pragma unroll
    for (int q = 0; q < N; ++q) in[q] = v[q];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
#pragma unroll
        for (int q = 0; q < N; ++q) {
            const i64 u = __shfl_up_sync(0xffffffffu, in[q], d);
            if (lane >= d) in[q] += u;
        }
    }
    if (lane == 31) {
#pragma unroll
        for (int q = 0; q < N; ++q) warp_sum[q][warp] = in[q];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int q = 0; q < N; ++q) {
            i64 w = lane < WARPS ? warp_sum[q][lane] : 0;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const i64 u = __shfl_up_sync(0xffffffffu, w, d);
                if (lane >= d) w += u;
            }
            if (lane < WARPS) warp_sum[q][lane] = w;
        }
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < N; ++q) {
        excl[q] = (warp ? warp_sum[q][warp - 1] : 0) + in[q] - v[q];
        tot[q] = warp_sum[q][WARPS - 1];
    }
    __syncthreads();  // the totals are read before anyone reuses the arrays
}

// Scan all rows with THREADS threads, a tile of THREADS rows at a time (one row per thread), carrying the
// running sums across tiles. The loads of ROW_BATCH tiles (and then their seeds) are issued together, so a
// batch costs two memory round trips, not two per tile. Fills the row table (shared or global memory) and,
// when WRITE_SIDE, the write offsets, the zeroed tail and the seeds. Returns the verify total; row_flags gets
// the OR of all row flags (every thread), seed_bad whether a seed fell outside the LUT. Only what every step
// needs: a sampled step derives the rest of its table in sample_rows (a third scanned value and three more
// stores here cost every plan registers, spills and 10-18% of its time).
template <int THREADS, int BATCH, bool HAS_LUT, bool HAS_POOL, bool WRITE_SIDE, int FORM>
__device__ __forceinline__ i64 scan_rows(const PlanParams& p, RowTable t, int& row_flags, int& seed_bad) {
    const i64 bs = p.bs;
    const double inv_ps = FORM != CANARY_FORM_TOKENS ? 1.0 / (double)p.page_size : 0.0;
    i64 vcarry = 0, wcarry = 0;
    int flags = 0, bad = 0;
    for (i64 group = 0; group < bs; group += (i64)THREADS * BATCH) {  // uniform: the scans have barriers
        Row f[BATCH];
        i64 rp[BATCH], e[BATCH], len[BATCH], vl[BATCH], seed[BATCH], q[BATCH], lo[BATCH], hi[BATCH], key[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const i64 r = group + k * THREADS + threadIdx.x;
            rp[k] = 0; e[k] = 0; len[k] = 0; vl[k] = 0; q[k] = 0;
            if (r < bs) { rp[k] = step_rp(p, r); e[k] = step_extend(p, r); len[k] = step_prefix(p, r); }
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const i64 r = group + k * THREADS + threadIdx.x;
            if (HAS_POOL && r < bs && rp[k] != 0) {
                vl[k] = step_valid(p, r);
                q[k] = p.expected_token_pool_indices ? step_pool_row(p, r) : rp[k];
            }
            lo[k] = 0; hi[k] = 0;
            if (FORM == CANARY_FORM_PAGES && r < bs && rp[k] != 0) { lo[k] = load_indptr(p, r); hi[k] = load_indptr(p, r + 1); }
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            i64 cap = p.max_seq_len;
            bool key_bad = false;
            if (FORM == CANARY_FORM_PAGES) key[k] = row_key<FORM>(p, rp[k], lo[k], hi[k], cap, key_bad);
            f[k] = row_facts<HAS_POOL>(p, rp[k], e[k], len[k], vl[k], q[k], cap, key_bad);
            if (FORM != CANARY_FORM_PAGES) key[k] = f[k].rp;  // the row's rp (0 for padding rows): as before the forms
            seed[k] = -1;
            if (WRITE_SIDE && f[k].wlen > 0 && rp[k] == 0) seed[k] = CANARY_SKIP_SEED;
            else if (WRITE_SIDE && f[k].wlen > 0 && f[k].len > 0 &&
                     !(f[k].flags & (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN))) {
                seed[k] = load_raw<FORM>(p, key[k] * p.r2t_row_stride + (f[k].len - 1), inv_ps, bad);
                if (CANARY_PADDING_NEG && seed[k] < 0) seed[k] = CANARY_MISSING_SLOT;
            }
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const i64 r = group + k * THREADS + threadIdx.x;
            if (group + k * THREADS >= bs) break;  // uniform across the block
            const i64 v[2] = {f[k].vcount, f[k].wlen};
            i64 excl[2], tot[2];
            block_scan<THREADS, 2>(v, excl, tot);
            const i64 voff = excl[0] + vcarry, woff = excl[1] + wcarry;
            if (r < bs) {
                t.off[r] = voff;
                if (f[k].vcount > 0) {
                    const i64 start = f[k].len - f[k].vcount;
                    t.base[r] = key[k] * p.r2t_row_stride + start - voff;
                    t.pdelta[r] = start - voff;
                    if (HAS_POOL) {
                        t.pbase[r] = q[k] * p.pool_row_stride;
                        t.vlim[r] = vl[k];
                    }
                }
                if (WRITE_SIDE) {
                    p.write_offsets[r] = woff;
                    const i64 sv = translate<HAS_LUT>(seed[k], p.lut, p.lut_len, bad);
                    // padding_slot = -1: a seed read from the index (the sentinels are negative already, and
                    // a raw padding marker was made MISSING_SLOT at the load) that is no slot (SPEC 3.2).
                    p.seeds[r] = CANARY_PADDING_NEG && seed[k] >= 0 && sv < 0 ? CANARY_MISSING_SLOT : sv;
                }
                flags |= f[k].flags;
            }
            vcarry += tot[0];
            wcarry += tot[1];
        }
    }
    if (threadIdx.x == 0) t.off[bs] = vcarry;
    if (WRITE_SIDE) {
        for (i64 r = bs + 1 + threadIdx.x; r <= p.write_req_capacity; r += THREADS) p.write_offsets[r] = 0;
        if (threadIdx.x == 0) { p.write_offsets[bs] = wcarry; *p.write_num_valid_reqs = (int)bs; }
    }
    __shared__ int s_flags;
    if (threadIdx.x == 0) s_flags = 0;
    seed_bad = __syncthreads_or(bad);  // also publishes s_flags = 0 and the row table
    if (flags) atomicOr(&s_flags, flags);
    __syncthreads();
    row_flags = s_flags;
    return vcarry;
}
