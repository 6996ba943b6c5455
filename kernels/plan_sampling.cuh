// Part of kernels/plan.cu, which includes it in order after canary_constants.cuh (not a standalone header):
// a sampled step (SPEC 3.7): the rotation, each row's run and first entry, the sampled table (rank_rows,
// sample_rows, sample_rows_at_once) and the cursors' update.

// Head of the request rotation of a step with fewer entries than requests (SPEC 3.7): cursors[0] as read
// (head_raw), if in range.
__device__ __forceinline__ i64 rotation_head(i64 head_raw, i64 requests) {
    return head_raw >= 0 && head_raw < requests ? head_raw : 0;
}

// The head after a step of cap < requests entries: (head + cap) mod requests, one subtraction (< 2 * requests).
__device__ __forceinline__ i64 next_head(i64 head, i64 cap, i64 requests) {
    const i64 next = head + cap;
    return next >= requests ? next - requests : next;
}

// A row's cursor as an offset in its window [lo, lo + len) (SPEC 3.7), 0 for a cursor outside the window.
__device__ __forceinline__ i64 cursor_offset(i64 cur, i64 lo, i64 len) {
    return cur >= lo && cur < lo + len ? cur - lo : 0;
}

// Where row r's run starts in its window, given its cursor's offset: the walk goes down the window a block at a
// time, so the run of `take` entries ends where the last one began (at the window's end for a cursor outside
// it), and positions appended at the end wait behind the walk instead of outrunning it. 0 <= take <= len: one
// addition wraps.
__device__ __forceinline__ i64 run_start(i64 offset, i64 take, i64 len) {
    const i64 run = offset - take;
    return run < 0 ? run + len : run;
}

// A sampled step's table (SPEC 3.7) is built in two rounds over the rows, each thread owning rows x, x + THREADS,
// ... in both, so that it reads back only what it wrote. rank_rows: from the scan's table (off, base, pdelta still
// unsampled) each row's window (lo, len), its rank among the rows with entries and its run (its cursor, read
// here); sample_rows: each row's first output entry, the table rewritten around it. Before (run 44), rank_rows
// only ranked and sample_rows re-read req_pool_indices, then the cursor behind it, and the rows kernel reset the
// cursors in a third round that re-read the table: on the two-pass path's one block, about 12 dependent round
// trips at bs=4096. Now the cursor loads are issued right behind req_pool_indices, before the rank scan, so their
// round trip hides behind it, and the reset is done from registers in sample_rows.
//
// rank_rows stores lo, len and, as stand-ins until sample_rows, rank in base[r], rp in rank[r] (what the cursor
// update needs) and the cursor's offset in its window in pdelta[r] (sample_rows turns it into the run once the
// take is known, and rebuilds pdelta and base). rp, pdelta and rank are stored for rows with entries only (the
// others are never emitted from nor advanced). BATCH tiles' loads are issued together and ranked by one block
// scan. head_raw gets cursors[0] as read here, before anyone writes it. Returns the number of rows with entries. Ends on a barrier:
// every cursor read of this block is done, and every read of off[r + 1] before sample_rows rewrites off.
template <int THREADS, int BATCH>
__device__ __forceinline__ i64 rank_rows(const PlanParams& p, RowTable t, i64& head_raw) {
    head_raw = p.cursors[0];
    i64 carry = 0;
    for (i64 group = 0; group < p.bs; group += (i64)THREADS * BATCH) {  // uniform: the scan has barriers
        i64 o0[BATCH], len[BATCH], pd[BATCH], rp[BATCH], cur[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const i64 r = group + k * THREADS + threadIdx.x;
            o0[k] = 0; len[k] = 0; pd[k] = 0; rp[k] = 0;
            if (r < p.bs) { o0[k] = t.off[r]; len[k] = t.off[r + 1]; pd[k] = t.pdelta[r]; rp[k] = step_rp(p, r); }
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {  // a row with entries is trusted: 0 < rp < max_reqs
            len[k] -= o0[k];
            cur[k] = len[k] > 0 ? p.cursors[rp[k]] : 0;
        }
        i64 v[BATCH], excl[BATCH], tot[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; ++k) v[k] = len[k] > 0 ? 1 : 0;
        block_scan<THREADS, BATCH>(v, excl, tot);
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const i64 r = group + k * THREADS + threadIdx.x;
            if (r < p.bs) {
                const i64 lo = len[k] > 0 ? pd[k] + o0[k] : 0;
                t.lo[r] = lo;
                t.len[r] = len[k];
                t.base[r] = excl[k] + carry;
                if (len[k] > 0) {
                    t.pdelta[r] = cursor_offset(cur[k], lo, len[k]);
                    t.rank[r] = rp[k];
                }
            }
            carry += tot[k];
        }
    }
    __syncthreads();
    return carry;
}

// What a sampled step's rows share (SPEC 3.7): the budget, the requests (rows with entries), the entries asked,
// and the rotation head (cursors[0] as read, if in [0, requests)).
struct Split {
    i64 cap, requests, total, head;
    i64 spare;   // cap >= requests: first = rank + floor(spare * (off - rank) / (total - requests)), spare = cap -
    double inv;  // requests (0 otherwise); off - rank <= total - requests, so the quotient is at most spare < 2^31
};               // (capacities are int32), within floor_div's 2^50; the products are < 2^62 (refused at bind otherwise)

__device__ __forceinline__ Split split_of(const PlanParams& p, i64 total, i64 requests, i64 head_raw) {
    Split s;
    s.cap = p.verify_capacity;
    s.requests = requests;
    s.total = total;
    s.head = s.cap < requests ? rotation_head(head_raw, requests) : 0;
    s.spare = s.cap >= requests ? s.cap - requests : 0;
    s.inv = 1.0 / (double)(total - requests);  // total >= requests; inf when equal, then only with cap < requests
    return s;
}

// first[r] of SPEC 3.7: the first output entry of a row with m rows with entries before it and `off` entries
// (unsampled) before it. Also first[r + 1] when called with (m + 1, off + L[r]), which is how a side block finds a
// row's take without its neighbour.
// Branch-free: both rules are computed and one is selected, so that a row's two calls (its first entry and its
// next row's) are independent chains the scheduler interleaves (branches around them serialized the two).
__device__ __forceinline__ i64 first_entry(const Split& s, i64 m, i64 off) {
    // cap >= requests: one entry each, the rest in proportion to len - 1 (the running sum rounded)
    const i64 share = m + floor_div(s.spare * (off - m), s.total - s.requests, s.inv);
    // cap < requests: the requests of ranks [head, head + cap) take one entry each, or, when the range wraps,
    // ranks [head, requests) and [0, head + cap - requests)
    const i64 after = max(m - s.head, (i64)0);
    const i64 turn = s.head + s.cap <= s.requests ? min(after, s.cap) : min(m, s.head + s.cap - s.requests) + after;
    return s.cap >= s.requests ? share : turn;
}

// The second round (see rank_rows), in the two-pass rows kernel without side blocks (its block 0 is then the
// cursors' only reader): off[r] becomes first[r], the row's first output entry, and base / pdelta start the row at
// its run; rank[r] keeps rp. The cursors of the rows that take entries are reset and the head moved here, from
// registers (rank_rows' barrier: every read is done); the entries kernel advances them.
template <int THREADS, int BATCH, int FORM>
__device__ __forceinline__ void sample_rows(const PlanParams& p, RowTable t, i64 total, i64 requests, i64 head_raw) {
    const Split sp = split_of(p, total, requests, head_raw);
    const i64 cap = sp.cap, head = sp.head;
    for (i64 r0 = threadIdx.x; r0 < p.bs; r0 += (i64)THREADS * BATCH) {
        i64 m[BATCH], off[BATCH], len[BATCH], pd[BATCH], rp[BATCH], lo[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const i64 r = r0 + (i64)k * THREADS;
            m[k] = 0; off[k] = 0; len[k] = 0; pd[k] = 0; rp[k] = 0; lo[k] = 0;
            if (r < p.bs) {
                m[k] = t.base[r]; off[k] = t.off[r]; len[k] = t.len[r];
                if (len[k] > 0) { pd[k] = t.pdelta[r]; rp[k] = t.rank[r]; lo[k] = t.lo[r]; }
            }
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const i64 r = r0 + (i64)k * THREADS;
            if (r >= p.bs) continue;
            const i64 first = first_entry(sp, m[k], off[k]);
            if (len[k] > 0) {  // pd: the cursor's offset (rank_rows)
                const i64 take = first_entry(sp, m[k] + 1, off[k] + len[k]) - first;
                const i64 pdelta = lo[k] + run_start(pd[k], take, len[k]) - first;
                t.pdelta[r] = pdelta;
                // a row with entries has a good key: a page list's is its first page (plan_index.cuh row_key)
                const i64 key = FORM == CANARY_FORM_PAGES ? load_indptr(p, r) : rp[k];
                t.base[r] = key * p.r2t_row_stride + pdelta;
                if (take > 0) p.cursors[rp[k]] = (i64)(-0x7fffffffffffffffLL - 1);
            }
            t.off[r] = first;
        }
    }
    if (threadIdx.x == 0) {
        t.off[p.bs] = cap;
        if (cap < requests) p.cursors[0] = next_head(head, cap, requests);
    }
    __syncthreads();
}

// A sampled step's table in one round, for a batch whose rows all fit the block's registers at once
// (bs <= THREADS * BATCH: the fused launch). rank_rows and sample_rows in one: the rank scan gives `requests` at
// once, so each row's first entry is computed from registers and the table written once (the two rounds stored
// five arrays and read them back across two more barriers). The table as sample_rows leaves it; head_raw as in
// rank_rows. Returns the number of rows with entries; ends on a barrier.
template <int THREADS, int BATCH, int FORM>
__device__ __forceinline__ i64 sample_rows_at_once(const PlanParams& p, RowTable t, i64 total, i64& head_raw) {
    head_raw = p.cursors[0];
    i64 o0[BATCH], len[BATCH], pd[BATCH], rp[BATCH], cur[BATCH], key[BATCH];
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
        const i64 r = k * THREADS + threadIdx.x;
        o0[k] = 0; len[k] = 0; pd[k] = 0; rp[k] = 0;
        if (r < p.bs) { o0[k] = t.off[r]; len[k] = t.off[r + 1]; pd[k] = t.pdelta[r]; rp[k] = step_rp(p, r); }
    }
    if (FORM == CANARY_FORM_PAGES) {
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {  // a row with entries has a good key: a page list's is its first page
            const i64 r = k * THREADS + threadIdx.x;
            key[k] = r < p.bs && len[k] > o0[k] ? load_indptr(p, r) : 0;
        }
    }
    // The rank counts flags, not sums: a ballot and a population count in each warp, then the warps' counts
    // (block_scan over int64 cost about 150 instructions a warp, most of this function's, run 84 profile).
    constexpr int WARPS = THREADS / 32;
    __shared__ int s_count[BATCH][WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int below[BATCH];
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {  // a row with entries is trusted: 0 < rp < max_reqs
        len[k] -= o0[k];
        cur[k] = len[k] > 0 ? p.cursors[rp[k]] : 0;
        const unsigned has = __ballot_sync(0xffffffffu, len[k] > 0);
        below[k] = __popc(has & ((1u << lane) - 1u));
        if (lane == 0) s_count[k][warp] = __popc(has);
    }
    __syncthreads();  // the warps' counts are in, and every read of off is done before the writes below
    i64 excl[BATCH], requests = 0;
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {  // the rows of tiles before k come first
        int before = 0, tile = 0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const int c = s_count[k][w];
            before += w < warp ? c : 0;
            tile += c;
        }
        excl[k] = requests + before + below[k];
        requests += tile;
    }
    const Split sp = split_of(p, total, requests, head_raw);
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
        const i64 r = k * THREADS + threadIdx.x;
        if (r >= p.bs) continue;
        const i64 first = first_entry(sp, excl[k], o0[k]);
        const i64 lo = len[k] > 0 ? pd[k] + o0[k] : 0;
        t.lo[r] = lo;
        t.len[r] = len[k];
        if (len[k] > 0) {  // the take from the next row's first entry in closed form (no neighbour to wait for)
            const i64 take = first_entry(sp, excl[k] + 1, o0[k] + len[k]) - first;
            const i64 pdelta = lo + run_start(cursor_offset(cur[k], lo, len[k]), take, len[k]) - first;
            t.pdelta[r] = pdelta;
            t.base[r] = (FORM == CANARY_FORM_PAGES ? key[k] : rp[k]) * p.r2t_row_stride + pdelta;
            t.rank[r] = rp[k];
        }
        t.off[r] = first;
    }
    if (threadIdx.x == 0) t.off[p.bs] = sp.cap;
    __syncthreads();
    return requests;
}

// The cursor update of a sampled step (SPEC 3.7), in two halves: a reset, once every reader has read the cursors,
// then advance_cursor. The two-pass rows kernel without side blocks resets in sample_rows and its entries kernel
// advances; the fused launch's extra block does both (update_cursors); side blocks merge the next cursors instead
// (side_rows, move_cursors). reset_cursors: each sampled row's cursor to INT64_MIN, and the rotation head moved
// (thread 0 only reads and writes cursors[0]; no row with entries has rp = 0). rank[r] holds the row's
// req_pool_indices value by now, so nothing is read from global memory again.
__device__ __forceinline__ void reset_cursors(const PlanParams& p, const RowTable& t, i64 requests) {
    for (i64 r = threadIdx.x; r < p.bs; r += blockDim.x)
        if (t.off[r + 1] > t.off[r]) p.cursors[t.rank[r]] = (i64)(-0x7fffffffffffffffLL - 1);
    const i64 cap = p.verify_capacity;
    if (threadIdx.x == 0 && cap < requests)
        p.cursors[0] = next_head(rotation_head(p.cursors[0], requests), cap, requests);
}

// advance_cursor, after the reset: row r's cursor to where its run began (lo + run = pdelta + first), where the
// next run ends (SPEC 3.7). A request row in two batch rows (an engine fault) keeps the larger new cursor,
// whatever the order of the atomics.
__device__ __forceinline__ void advance_cursor(const PlanParams& p, const RowTable& t, i64 r) {
    const i64 first = t.off[r];
    if (t.off[r + 1] > first)
        atomicMax(reinterpret_cast<long long*>(p.cursors + t.rank[r]), (long long)(t.pdelta[r] + first));
}

// Both halves with one block (the fused launch's extra block).
__device__ __forceinline__ void update_cursors(const PlanParams& p, const RowTable& t, i64 requests) {
    reset_cursors(p, t, requests);
    __syncthreads();
    for (i64 r = threadIdx.x; r < p.bs; r += blockDim.x) advance_cursor(p, t, r);
}
