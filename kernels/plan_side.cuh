// Part of kernels/plan.cu, which includes it in order after canary_constants.cuh (not a standalone header):
// the two-pass launch's tables in the scratch and the side blocks of a sampling planner's rows launch
// (side_rows), whose next cursors the entries kernel moves (move_cursors).

// The two-pass row table lives in scratch after the head words: TABLE_ARRAYS arrays of stride R + 1.
__device__ __forceinline__ RowTable global_table(const PlanParams& p) {
    i64* t = p.scratch + SCRATCH_TABLE;
    const i64 n = p.write_req_capacity + 1;  // bs <= R is checked on the host
    return RowTable{t, t + n, t + 2 * n, t + 3 * n, t + 4 * n, t + 5 * n, t + 6 * n, t + 7 * n};
}

// A sampled table built by the side blocks: its own off, base and pdelta (block 0 writes the scan's at the same
// time), the scan's pbase and vlim (the same values for every row with entries), and lo, len and rank, which only
// block 0's own sampled table (no side blocks) would use.
__device__ __forceinline__ RowTable side_table(const PlanParams& p) {
    RowTable t = global_table(p);
    const i64 n = p.write_req_capacity + 1;
    t.off = p.scratch + SCRATCH_TABLE + 8 * n;
    t.base = t.off + n;
    t.pdelta = t.off + 2 * n;
    return t;
}

// A side block of a sampling planner's two-pass rows launch (blocks 1.., one tile of SIDE_ROWS rows each): while
// block 0 scans the batch, the side blocks build a sampled step's table on other SMs, so that a sampled step's
// rows launch takes about as long as a full plan's. Block 0 alone took 26 us at bs=4096 against 12.5 for a full
// plan (run 71, Nsight Compute): its rank and table rounds were chains of dependent round trips, rows deep per
// thread, on one SM. No side block waits for another (a spin on other blocks would hang wherever the grid cannot
// be resident at once, as under MPS with a share of the SMs), which decides the design:
// - each thread owns SIDE_BATCH rows of the tile: their facts (row_facts, as the scan), cursors and runs, and the
//   tile's scans of the verify counts and of the rows with entries;
// - the block reads every other row's facts as well, for the sums before its tile and the batch's totals
//   (SIDE_ROWS-row tiles keep that cheap: tiles x bs row reads in all, and the host gives a batch capacity too
//   large for one wave of tiles to block 0 instead);
// - if the step samples: each row's first entry and take (first_entry, closed form), the sampled table, and the
//   row's next cursor, merged into next_cursors[rp] (scratch, + 1 so that 0 means none) with atomicMax: a request
//   row in two batch rows keeps the larger (SPEC 3.7). The cursors themselves are only read in this launch, so no
//   reader can see a write; the entries kernel moves next_cursors into them (move_cursors). Tile 0 leaves the
//   rotation head's next value in next_cursors[0] (no row with entries has rp = 0).
// Block 0's scan writes the status, the write side and the scan's table; the entries kernel reads this table
// when SCRATCH_SIDE says so.
template <bool HAS_POOL, int FORM>
__device__ __forceinline__ Row side_facts(const PlanParams& p, i64 r, i64& key) {
    const i64 rp = step_rp(p, r), e = step_extend(p, r), len = step_prefix(p, r);
    i64 vl = 0, q = 0, lo = 0, hi = 0;
    if (HAS_POOL && rp != 0) {
        vl = step_valid(p, r);
        q = p.expected_token_pool_indices ? step_pool_row(p, r) : rp;
    }
    if (FORM == CANARY_FORM_PAGES && rp != 0) { lo = load_indptr(p, r); hi = load_indptr(p, r + 1); }
    i64 cap = p.max_seq_len;
    bool key_bad = false;
    if (FORM == CANARY_FORM_PAGES) key = row_key<FORM>(p, rp, lo, hi, cap, key_bad);
    return row_facts<HAS_POOL>(p, rp, e, len, vl, q, cap, key_bad);
}

__device__ __forceinline__ u64* next_cursors(const PlanParams& p) {
    return reinterpret_cast<u64*>(p.scratch + SCRATCH_TABLE + TABLE_ARRAYS * (p.write_req_capacity + 1));
}

template <bool HAS_POOL, int FORM>
__device__ __forceinline__ void side_rows(const PlanParams& p) {
    // OTHERS: other rows' loads a thread keeps in flight (3 spilled)
    constexpr int THREADS = ROWS_THREADS, BATCH = SIDE_BATCH, OTHERS = 2;
    const i64 bs = p.bs, tile = (i64)blockIdx.x - 1, r0 = tile * SIDE_ROWS;
    if (r0 >= bs) return;  // uniform: the tile lies past the batch (the grid is sized from R, not bs)
    __shared__ int s_flags;
    if (threadIdx.x == 0) s_flags = 0;
    i64 rp[BATCH], lo[BATCH], cnt[BATCH], offset[BATCH], voff[BATCH], rank[BATCH], key[BATCH];
    const i64 head_raw = p.cursors[0];
    int flags = 0;
    i64 sums[4] = {0, 0, 0, 0};  // verify entries and rows with entries before the tile; both in the batch
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
        const i64 r = r0 + k * THREADS + threadIdx.x;
        Row f = {0, 0, 0, 0, 0};
        key[k] = 0;
        if (r < bs) f = side_facts<HAS_POOL, FORM>(p, r, key[k]);
        rp[k] = f.rp;
        cnt[k] = f.vcount;
        lo[k] = f.len - f.vcount;
        flags |= f.flags;
        const i64 cur = cnt[k] > 0 ? p.cursors[rp[k]] : 0;  // a row with entries is trusted: 0 < rp < max_reqs
        offset[k] = cnt[k] > 0 ? cursor_offset(cur, lo[k], cnt[k]) : 0;  // the run, once the take is known
        sums[2] += cnt[k];
        sums[3] += cnt[k] > 0 ? 1 : 0;
    }
    // Every other row, OTHERS a thread at a time, their loads issued together.
    for (i64 j0 = 0; j0 < bs; j0 += (i64)THREADS * OTHERS) {
        i64 orp[OTHERS], oe[OTHERS], olen[OTHERS], ovl[OTHERS], oq[OTHERS], olo[OTHERS], ohi[OTHERS];
        bool other[OTHERS];
#pragma unroll
        for (int u = 0; u < OTHERS; ++u) {
            const i64 j = j0 + u * THREADS + threadIdx.x;
            other[u] = j < bs && !(j >= r0 && j < r0 + SIDE_ROWS);
            orp[u] = 0; oe[u] = 0; olen[u] = 0; ovl[u] = 0; oq[u] = 0;
            if (other[u]) { orp[u] = step_rp(p, j); oe[u] = step_extend(p, j); olen[u] = step_prefix(p, j); }
        }
#pragma unroll
        for (int u = 0; u < OTHERS; ++u) {
            const i64 j = j0 + u * THREADS + threadIdx.x;
            if (HAS_POOL && other[u] && orp[u] != 0) {
                ovl[u] = step_valid(p, j);
                oq[u] = p.expected_token_pool_indices ? step_pool_row(p, j) : orp[u];
            }
            olo[u] = 0; ohi[u] = 0;
            if (FORM == CANARY_FORM_PAGES && other[u] && orp[u] != 0) {
                olo[u] = load_indptr(p, j);
                ohi[u] = load_indptr(p, j + 1);
            }
        }
#pragma unroll
        for (int u = 0; u < OTHERS; ++u) {
            if (!other[u]) continue;
            i64 cap = p.max_seq_len;
            bool key_bad = false;
            if (FORM == CANARY_FORM_PAGES) row_key<FORM>(p, orp[u], olo[u], ohi[u], cap, key_bad);
            const Row f = row_facts<HAS_POOL>(p, orp[u], oe[u], olen[u], ovl[u], oq[u], cap, key_bad);
            const i64 has = f.vcount > 0 ? 1 : 0;
            flags |= f.flags;
            sums[2] += f.vcount;
            sums[3] += has;
            if (j0 + u * THREADS + threadIdx.x < r0) { sums[0] += f.vcount; sums[1] += has; }
        }
    }
    i64 excl4[4], tot4[4];
    block_scan<THREADS, 4>(sums, excl4, tot4);  // the totals; s_flags = 0 is published by its barriers
    if (flags) atomicOr(&s_flags, flags);
    i64 vcarry = tot4[0], ccarry = tot4[1];
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
        const i64 v[2] = {cnt[k], cnt[k] > 0 ? 1 : 0};
        i64 excl[2], tot[2];
        block_scan<THREADS, 2>(v, excl, tot);  // ends on a barrier: s_flags is complete
        voff[k] = vcarry + excl[0];
        rank[k] = ccarry + excl[1];
        vcarry += tot[0];
        ccarry += tot[1];
    }
    const i64 total = tot4[2], requests = tot4[3];
    if (!sampling(p, s_flags, total)) return;  // uniform: every side block sees the same totals
    const RowTable t = side_table(p);
    u64* next = next_cursors(p);
    const Split sp = split_of(p, total, requests, head_raw);
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
        const i64 r = r0 + k * THREADS + threadIdx.x;
        if (r >= bs) continue;
        const i64 first = first_entry(sp, rank[k], voff[k]);
        t.off[r] = first;
        t.rank[r] = 0;  // the request row of a row that takes entries, else 0 (move_cursors reads only this)
        if (cnt[k] > 0) {
            const i64 take = first_entry(sp, rank[k] + 1, voff[k] + cnt[k]) - first;
            const i64 start = run_start(offset[k], take, cnt[k]);
            const i64 pdelta = lo[k] + start - first;
            t.pdelta[r] = pdelta;
            t.base[r] = (FORM == CANARY_FORM_PAGES ? key[k] : rp[k]) * p.r2t_row_stride + pdelta;
            t.lo[r] = lo[k];
            t.len[r] = cnt[k];
            if (take > 0) {  // the next run ends where this one begins
                t.rank[r] = rp[k];
                atomicMax(next + rp[k], (u64)(lo[k] + start) + 1);
            }
        }
    }
    if (threadIdx.x == 0) {
        if (r0 + SIDE_ROWS >= bs) t.off[bs] = sp.cap;
        if (tile == 0 && sp.cap < requests) next[0] = (u64)next_head(sp.head, sp.cap, requests) + 1;
    }
}

// The entries kernel's half of a side-built sampled step: each row that took entries moves its merged next cursor
// into the cursors (a request row in two batch rows: the first to take it moves it, the other finds 0), and the
// rotation head its next value. After the rows launch, so every cursor read is done. The words are zero again
// after every launch pair; a pair cut short (the entries launch failing after the rows launch) would leave words
// that the next sampled step merges with its own, a state SPEC 3.7 still calls safe (any cursor content is).
__device__ __forceinline__ void move_cursors(const PlanParams& p, const RowTable& t) {
    u64* next = next_cursors(p);
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < p.bs; r += (i64)gridDim.x * blockDim.x) {
        const i64 rp = t.rank[r];  // side_rows: 0 unless the row took entries (one load, not off[r] and off[r + 1])
        if (rp > 0) {
            const u64 v = atomicExch(next + rp, 0ull);
            if (v) p.cursors[rp] = (i64)v - 1;
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const u64 v = atomicExch(next, 0ull);
        if (v) p.cursors[0] = (i64)v - 1;
    }
}
