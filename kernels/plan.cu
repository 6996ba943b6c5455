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
// Specialized at compile time only on what changes the code path: HAS_LUT, HAS_POOL. 64-bit indices.

#define CANARY_OVERFLOW 1
#define CANARY_BAD_REQ_POOL_INDEX 2
#define CANARY_BAD_PREFIX_LEN 4
#define CANARY_BAD_SLOT 8
#define CANARY_BAD_VALID_LEN 16
#define CANARY_BAD_EXTEND_LEN 32
#define CANARY_SAMPLED 64   // total > capacity, on_overflow="sample": capacity entries verified (SPEC 3.7)
// Seed of a padding row whose tokens sit among the step's tokens (padding_rows_carry_tokens): the canary write
// skips its entries (canary/contract/plans.py SKIP_SEED). INT64_MIN: no int32 req_to_token value can produce it.
#define CANARY_SKIP_SEED (-0x7fffffffffffffffLL - 1)
// Verify slot of an entry of an active row whose slot is the padding slot (a req_to_token 0, or a real slot whose
// SWA page was freed inside the window), which verify must report, not skip as padding (canary/contract/plans.py
// MISSING_SLOT). -2^62: no int32 req_to_token value.
#define CANARY_MISSING_SLOT (-0x4000000000000000LL)
// The per-row lengths cannot be trusted: no verify entry is written.
#define CANARY_NO_ENTRIES \
    (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN | CANARY_BAD_VALID_LEN | CANARY_BAD_EXTEND_LEN)

#define ROWS_THREADS 1024   // canary_plan_rows_*: one block owns every row
#define ENTRY_THREADS 256   // canary_plan_fused_* and canary_plan_entries_*
#define FUSED_MAX_BS 512    // the fused kernel keeps its row table in shared memory
#define ITEMS 4             // verify entries per thread per pass: independent loads in flight
#define ENTRY_CHUNK (ITEMS * 32)  // entries of one warp pass
#define ROW_SAMPLES 512     // two-pass: row offsets sampled into shared memory to shorten the row search
#define ROW_BATCH 2         // row tiles whose loads the rows kernel issues together (4 spilled: 64 registers at 1024 threads)
#define FUSED_BATCH (FUSED_MAX_BS / ENTRY_THREADS)  // the fused scan: every row in one batch, no more registers
static_assert(FUSED_MAX_BS % ENTRY_THREADS == 0, "sample_rows_at_once: every fused row in one batch");
#define ENTRY_MIN_BLOCKS 4  // resident blocks per SM the register budget must allow (__launch_bounds__)

// Scratch words (int64, owned by the planner, zeroed once at bind, re-armed by every launch).
#define SCRATCH_DONE 0        // blocks finished (the last one finalizes)
#define SCRATCH_BAD_SLOT 1    // BAD_SLOT bits from entries and seeds
#define SCRATCH_ROW_FLAGS 2   // two-pass only: row checks of the rows kernel
#define SCRATCH_TOTAL 3       // two-pass only: verify entries in all
#define SCRATCH_READERS 4     // fused, sampled steps: emitting blocks done reading the cursors
#define SCRATCH_SIDE 5        // two-pass: side blocks of the rows launch (0: block 0 builds a sampled table)
#define SCRATCH_TABLE 6       // two-pass only: the row tables, TABLE_ARRAYS arrays of R + 1 (RowTable), then the
                              // side blocks' next cursors, max_reqs words (next_cursors; zero between launches)
#define TABLE_ARRAYS 11       // the scan's table (8 arrays), then a side-built sampled table's off, base, pdelta
#define SIDE_BATCH 1        // rows a thread of a side block owns (2 spilled in the rows kernel)
#define SIDE_ROWS (ROWS_THREADS * SIDE_BATCH)  // rows of one side block's tile

typedef long long i64;
typedef unsigned long long u64;

// One by-value kernel parameter; every field is 8 bytes, so the host packs it as an array of uint64 words in
// this order (canary/contract/plan_layout.py PARAM_FIELDS) and updates only the per-step words per call.
struct PlanParams {
    const i64* req_pool_indices;
    const i64* prefix_lens;
    const i64* extend_seq_lens;
    const i64* valid_lens;
    i64 bs;
    const int* req_to_token;
    i64 r2t_row_stride;
    i64 rp_bound;          // max_reqs (the pool's rows bound the pool row q: row_facts)
    i64 max_seq_len;
    const i64* lut;
    i64 lut_len;
    const int* pool;
    i64 pool_row_stride;
    i64 pool_cols;
    i64 token_offset;
    i64 window;
    i64 padding_rows_carry_tokens;  // 0 or 1 (SPEC 3.2): a padding row's E counts in write_offsets
    i64 verify_capacity;
    i64 write_req_capacity;
    i64* slots;
    i64* expected;
    i64* positions;
    i64* prevs;
    int* num_valid;
    int* enable;
    int* status;
    i64* write_offsets;
    i64* seeds;
    int* write_num_valid_reqs;
    i64* scratch;
    i64* cursors;          // [max_reqs] rotation state of the sampled verification (SPEC 3.7)
    i64 sample;            // 1: on_overflow="sample" (cursors given); 0: "skip"
    i64 pool_rows;
    // Per step, HAS_POOL only: the pool row of each batch row (SPEC 3.2); null: req_pool_indices.
    const i64* expected_token_pool_indices;
};

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
template <bool HAS_POOL>
__device__ __forceinline__ Row row_facts(const PlanParams& p, i64 rp, i64 e, i64 len, i64 vl, i64 q) {
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
    if (len < 0 || len > p.max_seq_len) f.flags |= CANARY_BAD_PREFIX_LEN;
    if (HAS_POOL && vl > p.pool_cols) f.flags |= CANARY_BAD_VALID_LEN;
    // The new tokens must fit the row: e > room, never len + e, which garbage such as 2^62 would wrap.
    const i64 room = p.max_seq_len - (len < 0 ? 0 : (len > p.max_seq_len ? p.max_seq_len : len));
    if (e > 0 && e > room) f.flags |= CANARY_BAD_EXTEND_LEN;
    else f.wlen = e > 0 ? e : 0;
    if (!(f.flags & (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN | CANARY_BAD_EXTEND_LEN)))
        f.vcount = (p.window > 0 && len > p.window) ? p.window : len;
    return f;
}

// What an entry needs of its row, found by one search over off[]. Entry i of row r (off[r] <= i < off[r+1]):
// position = i + pdelta[r], req_to_token index = base[r] + i; with col = position + token_offset, the
// expected-token index is pbase[r] + col, valid while 0 <= col < vlim[r] (compared as the reference does:
// valid_lens may be garbage such as INT64_MIN, and subtracting the offset from it would wrap).
// A sampled step (SPEC 3.7) rewrites off, base and pdelta so that row r's entries start at its run:
// position = i + pdelta[r] wraps once, from lo[r] + len[r] back to lo[r].
struct RowTable {
    i64* off;     // [bs + 1] exclusive scan of the verify counts (sampled: of the takes)
    i64* base;    // rp * r2t_row_stride + window_start - off[r]   (sampled: + run)
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
template <int THREADS, int BATCH, bool HAS_LUT, bool HAS_POOL, bool WRITE_SIDE>
__device__ __forceinline__ i64 scan_rows(const PlanParams& p, RowTable t, int& row_flags, int& seed_bad) {
    const i64 bs = p.bs;
    i64 vcarry = 0, wcarry = 0;
    int flags = 0, bad = 0;
    for (i64 group = 0; group < bs; group += (i64)THREADS * BATCH) {  // uniform: the scans have barriers
        Row f[BATCH];
        i64 rp[BATCH], e[BATCH], len[BATCH], vl[BATCH], seed[BATCH], q[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const i64 r = group + k * THREADS + threadIdx.x;
            rp[k] = 0; e[k] = 0; len[k] = 0; vl[k] = 0; q[k] = 0;
            if (r < bs) { rp[k] = p.req_pool_indices[r]; e[k] = p.extend_seq_lens[r]; len[k] = p.prefix_lens[r]; }
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const i64 r = group + k * THREADS + threadIdx.x;
            if (HAS_POOL && r < bs && rp[k] != 0) {
                vl[k] = p.valid_lens[r];
                q[k] = p.expected_token_pool_indices ? p.expected_token_pool_indices[r] : rp[k];
            }
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            f[k] = row_facts<HAS_POOL>(p, rp[k], e[k], len[k], vl[k], q[k]);
            seed[k] = -1;
            if (WRITE_SIDE && f[k].wlen > 0 && rp[k] == 0) seed[k] = CANARY_SKIP_SEED;
            else if (WRITE_SIDE && f[k].wlen > 0 && f[k].len > 0 &&
                     !(f[k].flags & (CANARY_BAD_REQ_POOL_INDEX | CANARY_BAD_PREFIX_LEN)))
                seed[k] = (i64)p.req_to_token[f[k].rp * p.r2t_row_stride + (f[k].len - 1)];
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
                    t.base[r] = f[k].rp * p.r2t_row_stride + start - voff;
                    t.pdelta[r] = start - voff;
                    if (HAS_POOL) {
                        t.pbase[r] = q[k] * p.pool_row_stride;
                        t.vlim[r] = vl[k];
                    }
                }
                if (WRITE_SIDE) {
                    p.write_offsets[r] = woff;
                    p.seeds[r] = translate<HAS_LUT>(seed[k], p.lut, p.lut_len, bad);
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
            if (r < p.bs) { o0[k] = t.off[r]; len[k] = t.off[r + 1]; pd[k] = t.pdelta[r]; rp[k] = p.req_pool_indices[r]; }
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

// floor(a / b) for 0 <= a < 2^62, 1 <= b < 2^62, a / b < 2^50, given inv_b = 1.0 / (double)b: a 64-bit integer
// division is a long subroutine on the GPU, this a multiply and one correction. Why one suffices: (double)a,
// (double)b, the reciprocal and the product each round once, relative error at most u = 2^-53 each, so the
// estimate is (a / b)(1 + d) with |d| < 5u, off by less than 2^50 * 5 * 2^-53 = 5/8 from a / b. It is >= 0 and
// truncates to q - 1, q or q + 1 (q the exact floor), so rem = a - est * b lies in [-b, 2b): one step corrects
// it, and est * b <= a + b < 2^63 does not overflow.
__device__ __forceinline__ i64 floor_div(i64 a, i64 b, double inv_b) {
    i64 q = (i64)((double)a * inv_b);
    const i64 rem = a - q * b;
    if (rem < 0) --q;
    else if (rem >= b) ++q;
    return q;
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
template <int THREADS, int BATCH>
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
                t.base[r] = rp[k] * p.r2t_row_stride + pdelta;
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
template <int THREADS, int BATCH>
__device__ __forceinline__ i64 sample_rows_at_once(const PlanParams& p, RowTable t, i64 total, i64& head_raw) {
    head_raw = p.cursors[0];
    i64 o0[BATCH], len[BATCH], pd[BATCH], rp[BATCH], cur[BATCH];
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
        const i64 r = k * THREADS + threadIdx.x;
        o0[k] = 0; len[k] = 0; pd[k] = 0; rp[k] = 0;
        if (r < p.bs) { o0[k] = t.off[r]; len[k] = t.off[r + 1]; pd[k] = t.pdelta[r]; rp[k] = p.req_pool_indices[r]; }
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
            t.base[r] = rp[k] * p.r2t_row_stride + pdelta;
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

// SAMPLED is a template flag so that a plan that verifies everything runs the code it ran before sampling.
template <bool HAS_LUT, bool HAS_POOL, bool SAMPLED>
__device__ __forceinline__ int emit_entries(const PlanParams& p, RowTable t, RowSamples samples, i64 total,
                                            i64 blocks) {
    int bad = 0;
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
        for (int k = 0; k < ITEMS; ++k) raw[k] = first + k * 32 + lane < total ? (i64)p.req_to_token[idx[k]] : 0;
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
            else if (pos[k] > 0) prev = translate<HAS_LUT>((i64)p.req_to_token[idx[k] - 1], p.lut, p.lut_len, bad);
            // The sentinel only in the stored slot: the lane to the right took slot[k] as its predecessor,
            // which keeps the plain translation (an evicted predecessor skips the chain check).
            p.slots[i] = (raw[k] == 0 || (HAS_LUT && raw[k] > 0 && slot[k] == 0)) ? CANARY_MISSING_SLOT : slot[k];
            p.prevs[i] = prev;
            p.positions[i] = pos[k];
            p.expected[i] = HAS_POOL ? tok[k] : -1;
        }
    }
    return bad;
}

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

// A sampled step of the fused launch. Every block reads the cursors (rank_rows) and the cursors may move only
// once all have. A sampling planner's fused grid has one block more than its entries need (plan_layout.py
// fused_grid): that last block emits nothing, waits until every other block has counted itself in (after its
// reads, without waiting for an answer), and moves the cursors with all its threads. No emitting warp waits for
// anything, so the update is off the plan's path (run 42: one warp of an emitting block moving them cost 1.9 us
// of a bs=256 step). The wait is a spin on co-resident blocks: the grid fits on the device at once, and the
// other blocks never wait for this one, so they always finish.
template <bool HAS_LUT, bool HAS_POOL>
__device__ __forceinline__ void fused_sampled(const PlanParams& p, RowTable t, int row_flags, i64 total, int bad) {
    i64 head_raw;
    const i64 requests = sample_rows_at_once<ENTRY_THREADS, FUSED_BATCH>(p, t, total, head_raw);  // reads done
    unsigned long long* readers = reinterpret_cast<unsigned long long*>(p.scratch) + SCRATCH_READERS;
    const i64 emitters = (i64)gridDim.x - 1;
    if (blockIdx.x == emitters) {
        if (threadIdx.x == 0) {
            while (atomicAdd(readers, 0ull) < (unsigned long long)emitters) __nanosleep(32);
            *readers = 0;  // every other block has been counted: re-armed for the next launch
        }
        __syncthreads();
        update_cursors(p, t, requests);
    } else {
        if (threadIdx.x == 0) atomicAdd(readers, 1ull);
        bad |= emit_entries<HAS_LUT, HAS_POOL, true>(p, t, RowSamples{nullptr, 0, 0}, p.verify_capacity, emitters);
    }
    if (HAS_LUT) finalize(p, row_flags, total, bad);
    else if (blockIdx.x == 0 && threadIdx.x == 0) write_status(p, row_flags, total);
}

template <bool HAS_LUT, bool HAS_POOL>
__device__ __forceinline__ void plan_fused(const PlanParams& p) {
    __shared__ i64 s_off[FUSED_MAX_BS + 1], s_base[FUSED_MAX_BS], s_pdelta[FUSED_MAX_BS];
    __shared__ i64 s_pbase[HAS_POOL ? FUSED_MAX_BS : 1], s_vlim[HAS_POOL ? FUSED_MAX_BS : 1];
    __shared__ i64 s_lo[FUSED_MAX_BS], s_len[FUSED_MAX_BS], s_rank[FUSED_MAX_BS];
    const RowTable t = {s_off, s_base, s_pdelta, s_pbase, s_vlim, s_lo, s_len, s_rank};
    int row_flags, seed_bad;
    const i64 total = blockIdx.x == 0
        ? scan_rows<ENTRY_THREADS, FUSED_BATCH, HAS_LUT, HAS_POOL, true>(p, t, row_flags, seed_bad)
        : scan_rows<ENTRY_THREADS, FUSED_BATCH, HAS_LUT, HAS_POOL, false>(p, t, row_flags, seed_bad);
    if (sampling(p, row_flags, total)) {
        fused_sampled<HAS_LUT, HAS_POOL>(p, t, row_flags, total, seed_bad);
        return;
    }
    // Without a LUT, the row scan alone decides everything: block 0 writes it.
    if (!HAS_LUT && blockIdx.x == 0 && threadIdx.x == 0) write_status(p, row_flags, total);
    int bad = seed_bad;
    if (total <= p.verify_capacity && !(row_flags & CANARY_NO_ENTRIES))
        bad |= emit_entries<HAS_LUT, HAS_POOL, false>(p, t, RowSamples{nullptr, 0, 0}, total, gridDim.x);
    if (HAS_LUT) finalize(p, row_flags, total, bad);
}

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
template <bool HAS_POOL>
__device__ __forceinline__ Row side_facts(const PlanParams& p, i64 r) {
    const i64 rp = p.req_pool_indices[r], e = p.extend_seq_lens[r], len = p.prefix_lens[r];
    i64 vl = 0, q = 0;
    if (HAS_POOL && rp != 0) {
        vl = p.valid_lens[r];
        q = p.expected_token_pool_indices ? p.expected_token_pool_indices[r] : rp;
    }
    return row_facts<HAS_POOL>(p, rp, e, len, vl, q);
}

__device__ __forceinline__ u64* next_cursors(const PlanParams& p) {
    return reinterpret_cast<u64*>(p.scratch + SCRATCH_TABLE + TABLE_ARRAYS * (p.write_req_capacity + 1));
}

template <bool HAS_POOL>
__device__ __forceinline__ void side_rows(const PlanParams& p) {
    // OTHERS: other rows' loads a thread keeps in flight (3 spilled)
    constexpr int THREADS = ROWS_THREADS, BATCH = SIDE_BATCH, OTHERS = 2;
    const i64 bs = p.bs, tile = (i64)blockIdx.x - 1, r0 = tile * SIDE_ROWS;
    if (r0 >= bs) return;  // uniform: the tile lies past the batch (the grid is sized from R, not bs)
    __shared__ int s_flags;
    if (threadIdx.x == 0) s_flags = 0;
    i64 rp[BATCH], lo[BATCH], cnt[BATCH], offset[BATCH], voff[BATCH], rank[BATCH];
    const i64 head_raw = p.cursors[0];
    int flags = 0;
    i64 sums[4] = {0, 0, 0, 0};  // verify entries and rows with entries before the tile; both in the batch
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
        const i64 r = r0 + k * THREADS + threadIdx.x;
        Row f = {0, 0, 0, 0, 0};
        if (r < bs) f = side_facts<HAS_POOL>(p, r);
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
        i64 orp[OTHERS], oe[OTHERS], olen[OTHERS], ovl[OTHERS], oq[OTHERS];
        bool other[OTHERS];
#pragma unroll
        for (int u = 0; u < OTHERS; ++u) {
            const i64 j = j0 + u * THREADS + threadIdx.x;
            other[u] = j < bs && !(j >= r0 && j < r0 + SIDE_ROWS);
            orp[u] = 0; oe[u] = 0; olen[u] = 0; ovl[u] = 0; oq[u] = 0;
            if (other[u]) { orp[u] = p.req_pool_indices[j]; oe[u] = p.extend_seq_lens[j]; olen[u] = p.prefix_lens[j]; }
        }
#pragma unroll
        for (int u = 0; u < OTHERS; ++u) {
            const i64 j = j0 + u * THREADS + threadIdx.x;
            if (HAS_POOL && other[u] && orp[u] != 0) {
                ovl[u] = p.valid_lens[j];
                oq[u] = p.expected_token_pool_indices ? p.expected_token_pool_indices[j] : orp[u];
            }
        }
#pragma unroll
        for (int u = 0; u < OTHERS; ++u) {
            if (!other[u]) continue;
            const Row f = row_facts<HAS_POOL>(p, orp[u], oe[u], olen[u], ovl[u], oq[u]);
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
            t.base[r] = rp[k] * p.r2t_row_stride + pdelta;
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

// One block: the scans, and for a sampled step the sampled table and the cursors' reset (this block is the only
// reader of the cursors, so it may reset them once its threads have read them: rank_rows ends on a barrier).
// The entries kernel advances them, a row per thread over its grid: on one block that half was a chain of
// dependent round trips, rows deep per thread (run 44: a bs=4096 sampled step 44.7 us against 24.2 for a full
// plan of its capacity).
template <bool HAS_LUT, bool HAS_POOL>
__device__ __forceinline__ void plan_rows(const PlanParams& p) {
    if (blockIdx.x > 0) {
        side_rows<HAS_POOL>(p);
        return;
    }
    const RowTable t = global_table(p);
    int row_flags, seed_bad;
    const i64 total = scan_rows<ROWS_THREADS, ROW_BATCH, HAS_LUT, HAS_POOL, true>(p, t, row_flags, seed_bad);
    row_flags |= seed_bad ? CANARY_BAD_SLOT : 0;
    if (gridDim.x == 1 && sampling(p, row_flags, total)) {  // no side blocks: this block builds the table
        i64 head_raw;
        const i64 requests = rank_rows<ROWS_THREADS, ROW_BATCH>(p, t, head_raw);
        sample_rows<ROWS_THREADS, ROW_BATCH>(p, t, total, requests, head_raw);
    }
    if (threadIdx.x == 0) {
        p.scratch[SCRATCH_ROW_FLAGS] = row_flags;
        p.scratch[SCRATCH_TOTAL] = total;
        p.scratch[SCRATCH_SIDE] = (i64)gridDim.x - 1;
        if (!HAS_LUT) write_status(p, row_flags, total);
    }
}

template <bool HAS_LUT, bool HAS_POOL>
__device__ __forceinline__ void plan_entries(const PlanParams& p) {
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
        bad = emit_entries<HAS_LUT, HAS_POOL, true>(p, t, RowSamples{s_samples, step, count}, emitted, gridDim.x);
        // The cursors' second half, after the entries, off their path: nothing in this launch reads a cursor, so
        // no block waits for another. Side blocks merged the next cursors; without them, plan_rows reset them.
        if (side)
            move_cursors(p, t);
        else
            for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < p.bs; r += (i64)gridDim.x * blockDim.x)
                advance_cursor(p, t, r);
    } else if (total <= p.verify_capacity && !(row_flags & CANARY_NO_ENTRIES))
        bad = emit_entries<HAS_LUT, HAS_POOL, false>(p, t, RowSamples{s_samples, step, count}, emitted, gridDim.x);
    if (HAS_LUT) finalize(p, row_flags, total, bad);
}

#define CANARY_SPECIALIZE(SUFFIX, HAS_LUT, HAS_POOL)                                                           \
    extern "C" __global__ void __launch_bounds__(ENTRY_THREADS, ENTRY_MIN_BLOCKS) canary_plan_fused_##SUFFIX(const PlanParams p) { \
        plan_fused<HAS_LUT, HAS_POOL>(p);                                                                      \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ROWS_THREADS) canary_plan_rows_##SUFFIX(const PlanParams p) {  \
        plan_rows<HAS_LUT, HAS_POOL>(p);                                                                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ENTRY_THREADS, ENTRY_MIN_BLOCKS) canary_plan_entries_##SUFFIX(const PlanParams p) { \
        plan_entries<HAS_LUT, HAS_POOL>(p);                                                                    \
    }

CANARY_SPECIALIZE(lut0_pool0, false, false)
CANARY_SPECIALIZE(lut1_pool0, true, false)
CANARY_SPECIALIZE(lut0_pool1, false, true)
CANARY_SPECIALIZE(lut1_pool1, true, true)
