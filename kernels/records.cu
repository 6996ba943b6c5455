// kv-canary write / verify / scatter kernels (SPEC 4, docs/records.md), compiled by NVRTC through CuPy.
// Numba twin: records_numba.py. NumPy reference: canary/backends/reference/records.py.
//
// Every launch takes ONE by-value parameter struct whose fields are all 8 bytes, so the host packs it as an
// array of uint64 words (canary/contract/records_layout.py lists the fields; a CI test pins the order) and
// rewrites only the per-call words. Counts that change per step (write_num_valid_reqs, verify_num_valid,
// enable, check_flags) are read on the device and grids depend only on capacities, so a captured CUDA graph
// stays right after the caller refills its buffers in place.
//
// Values are hashed and compared as unsigned 64-bit bit patterns (wraparound is defined for u64, not i64).

// The constants, sentinels and parameter structs come from canary_constants.cuh (generated from
// canary/contract/records_layout.py, layers_layout.py, ring.py, hashes.py and plans.py).
#include "canary_constants.cuh"
#include "canary_ints.cuh"

#define WRITE_WARPS (WRITE_THREADS / 32)

// The records' padding_slot (SPEC 3.2 "No reserved slot", 4), given by the host (one module each): 0, slot 0 is
// padding (verify and verify_layer skip it; a predecessor 0 has no link), the code it always was; 1 for
// padding_slot = -1, slot 0 is verified like any slot and a predecessor MISSING_SLOT has no link. The write has no
// padding slot (slot < 0 skips it in both).
#ifndef CANARY_PADDING_NEG
#define CANARY_PADDING_NEG 0
#endif
#define FIRST_SLOT (CANARY_PADDING_NEG ? 0 : 1)
#define NO_LINK (CANARY_PADDING_NEG ? CANARY_MISSING_SLOT : 0)

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

__device__ __forceinline__ u64 mix3(u64 a, u64 b, u64 c) {
    return splitmix64(splitmix64(splitmix64(a) ^ b) ^ c);
}

// a * b mod P for a, b < 2^61: the 122-bit product folds at bit 61 (2^61 = 1 mod P), twice, then one subtract.
__device__ __forceinline__ u64 mulmod_p(u64 a, u64 b) {
    const u64 lo = a * b, hi = __umul64hi(a, b);
    u64 r = (lo & FIELD_P) + ((lo >> 61) | (hi << 3));
    r = (r & FIELD_P) + (r >> 61);
    return r >= FIELD_P ? r - FIELD_P : r;
}

__device__ __forceinline__ u64 addmod_p(u64 a, u64 b) {
    const u64 s = a + b;
    return s >= FIELD_P ? s - FIELD_P : s;
}

// g(t, p) = mix3(CHAIN_ANCHOR, t, p) mod P (the anchor's own splitmix64 is the constant G_KEY).
__device__ __forceinline__ u64 chain_g(u64 tok, u64 pos) {
    u64 x = splitmix64(splitmix64(G_KEY ^ tok) ^ pos);
    x = (x & FIELD_P) + (x >> 61);
    return x >= FIELD_P ? x - FIELD_P : x;
}

// The field value h of a chain value CHAIN_TAG | h; false for anything else (bits 63..61 not 010, or h = P).
__device__ __forceinline__ bool chain_field(u64 v, u64* h) {
    *h = v & FIELD_P;
    return (v >> 61) == 2ULL && *h != FIELD_P;
}

__device__ __forceinline__ u64 chain_link(u64 prev_hash, u64 tok, u64 pos) {
    u64 h;
    if (!chain_field(prev_hash, &h)) return NOT_A_LINK;
    return CHAIN_TAG | addmod_p(mulmod_p(CHAIN_MUL, h), chain_g(tok, pos));
}

__device__ __forceinline__ i64 clamp64(i64 v, i64 lo, i64 hi) { return v < lo ? lo : (v > hi ? hi : v); }

__device__ __forceinline__ const u64* slot_record(const StateParams& st, i64 slot) {
    return reinterpret_cast<const u64*>(st.canary + slot * st.slot_stride);
}

// SPEC 4's real-KV fold of one slot in [0, num_slots): per source h = s(h ^ w) over its words, then
// acc = s(acc ^ h) over the sources in order, then acc | 1. Loads are 16 bytes (base and strides are multiples
// of 16). The forced bit keeps every fold off 0, the hash of a never-written record, which all-zero KV bytes
// would otherwise reach (s(0) == 0); without sources (mode NONE) the hash stays 0.
__device__ u64 fold_slot(const RealKVParams& kv, i64 slot) {
    u64 acc = 0;
#pragma unroll
    for (int s = 0; s < MAX_SOURCES; ++s) {
        if (s < kv.num_sources) {
            const i64 ps = kv.page_size[s];
            const ulonglong2* q = reinterpret_cast<const ulonglong2*>(
                kv.base[s] + (slot / ps) * kv.row_stride_bytes[s] + (slot % ps) * kv.num_bytes_per_token[s]);
            const i64 pairs = kv.read_words[s] >> 1;
            u64 h = 0;
            for (i64 w = 0; w < pairs; ++w) {
                const ulonglong2 v = q[w];
                h = splitmix64(h ^ v.x);
                h = splitmix64(h ^ v.y);
            }
            acc = splitmix64(acc ^ h);
        }
    }
    return kv.num_sources > 0 ? (acc | 1ULL) : acc;
}

// SPEC 4's reported slots: whether slot s's byte has `bit` (1: its verify rows, 2: its MISSING successors' rows),
// i.e. the caller already holds that report and the row would only take a ring row from an unreported slot.
// Read only on a failing row, so a clean step never touches the array (it may be pinned host memory).
__device__ __forceinline__ bool reported(const StateParams& st, i64 s, unsigned int bit) {
    return st.reported_slots != nullptr && s >= 0 && s < st.num_slots && (st.reported_slots[s] & bit) != 0;
}

// Fill-once ring: claim an index; write the row only if it fits. The index keeps counting past capacity.
__device__ void append_row(const StateParams& st, u64 slot, u64 position, u64 stored_token, u64 expected_token,
                           u64 stored_hash, u64 expected_aux, u64 reasons) {
    const unsigned int k = atomicAdd(st.ring_write_index, 1u);
    if ((i64)k < st.ring_capacity) {
        i64* row = st.ring + (i64)k * st.ring_row_stride;
        row[0] = st.tag;
        row[1] = (i64)slot;
        row[2] = (i64)position;
        row[3] = (i64)stored_token;
        row[4] = (i64)expected_token;
        row[5] = (i64)stored_hash;
        row[6] = (i64)expected_aux;
        row[7] = (i64)reasons;
    }
}

// The block's count of processed entries, added once to a run counter. A warp sums its lanes with shuffles
// first: one shared-memory atomic per warp, not per thread (every thread adding to one shared word was the
// verify kernel's main stall, Nsight Compute on an H200: issue 14). Every thread of the block calls it.
__device__ __forceinline__ void add_block_count(unsigned long long* s_count, unsigned long long mine,
                                                unsigned long long* counter) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, d);
    if ((threadIdx.x & 31) == 0 && mine) atomicAdd(s_count, mine);
    __syncthreads();
    if (threadIdx.x == 0 && *s_count) atomicAdd(counter, *s_count);
}

// A scan element of the write: the affine map h -> a h + b of a run of entries, and the position of its last
// chain-advancing entry (has = 0: none). combine(f, s) is "f, then s".
struct ChainElem {
    u64 a, b, pos;
    int has;
};

__device__ __forceinline__ ChainElem chain_identity() { return ChainElem{1ULL, 0ULL, 0ULL, 0}; }

__device__ __forceinline__ ChainElem combine(const ChainElem& f, const ChainElem& s) {
    return ChainElem{mulmod_p(s.a, f.a), addmod_p(mulmod_p(s.a, f.b), s.b), s.has ? s.pos : f.pos, f.has | s.has};
}

__device__ __forceinline__ ChainElem shfl_up_elem(const ChainElem& e, int d) {
    return ChainElem{__shfl_up_sync(0xffffffffu, e.a, d), __shfl_up_sync(0xffffffffu, e.b, d),
                     __shfl_up_sync(0xffffffffu, e.pos, d), __shfl_up_sync(0xffffffffu, e.has, d)};
}

// Block-wide scan of one element per thread (every thread calls it): warps scan with shuffles, warp 0 scans
// the warp totals. Returns the thread's exclusive prefix (identity for thread 0); *total gets the block's.
__device__ ChainElem block_scan(ChainElem e, ChainElem* total, ChainElem* s_warp) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const ChainElem o = shfl_up_elem(e, d);
        if (lane >= d) e = combine(o, e);
    }
    if (lane == 31) s_warp[warp] = e;
    __syncthreads();
    if (warp == 0) {
        ChainElem w = lane < WRITE_WARPS ? s_warp[lane] : chain_identity();
#pragma unroll
        for (int d = 1; d < WRITE_WARPS; d <<= 1) {
            const ChainElem o = shfl_up_elem(w, d);
            if (lane >= d) w = combine(o, w);
        }
        if (lane < WRITE_WARPS) s_warp[lane] = w;
    }
    __syncthreads();
    const ChainElem before = warp > 0 ? s_warp[warp - 1] : chain_identity();
    const ChainElem up = shfl_up_elem(combine(before, e), 1);
    *total = s_warp[WRITE_WARPS - 1];
    __syncthreads();  // s_warp is reused by the next scan
    return lane > 0 ? up : before;
}

// Entries per segment of a request of len > 0 entries: at most WRITE_MAX_SEGMENTS segments, whole tiles each.
__device__ __forceinline__ i64 segment_len(i64 len) {
    const i64 per = (len + WRITE_MAX_SEGMENTS - 1) / WRITE_MAX_SEGMENTS;
    return (per + WRITE_THREADS - 1) / WRITE_THREADS * WRITE_THREADS;
}

// Slots of one tile, hashed: a slot's entry is stored only by its last occurrence in the tile (the highest
// thread). An open-addressing table at twice the tile keeps probes short; keys are claimed with atomicCAS and
// the owner is the atomicMax of the threads inserting that key, so the result does not depend on timing.
#define DEDUP_SIZE (2 * WRITE_THREADS)
#define DEDUP_EMPTY (-1LL)

struct WriteShared {
    i64 key[DEDUP_SIZE];
    int owner[DEDUP_SIZE];
    ChainElem warp[WRITE_WARPS];
    ChainElem lb;  // look_back's result, from warp 0 to the block
    i64 lb_end;
    int lb_last;
};

__device__ __forceinline__ int dedup_home(i64 slot) {
    return (int)(((u64)slot * 0x9E3779B97F4A7C15ULL) >> 55) & (DEDUP_SIZE - 1);  // Fibonacci hashing, 9 bits
}

__device__ __forceinline__ void dedup_insert(WriteShared& sh, i64 slot, int tid) {
    for (int b = dedup_home(slot);; b = (b + 1) & (DEDUP_SIZE - 1)) {
        const i64 old = (i64)atomicCAS(reinterpret_cast<unsigned long long*>(&sh.key[b]), (unsigned long long)DEDUP_EMPTY,
                                       (unsigned long long)slot);
        if (old == DEDUP_EMPTY || old == slot) {
            atomicMax(&sh.owner[b], tid);
            return;
        }
    }
}

__device__ __forceinline__ bool dedup_last(const WriteShared& sh, i64 slot, int tid) {
    int b = dedup_home(slot);
    while (sh.key[b] != slot) b = (b + 1) & (DEDUP_SIZE - 1);
    return sh.owner[b] == tid;
}

// a^e mod P by squaring (e: a count of entries).
__device__ __forceinline__ u64 powmod_p(u64 a, i64 e) {
    u64 r = 1;
    for (; e > 0; e >>= 1) {
        if (e & 1) r = mulmod_p(r, a);
        a = mulmod_p(a, a);
    }
    return r;
}

// The chain map of entries [i0, i1) of the write, composed by one thread: two interleaved halves, each an
// independent serial chain b -> A b + g (the multiplier A is the same for every advancing entry, so a run's map
// is (A^count, b) and only b is serial), joined at the end. Every input is loaded whatever the slot (the
// indices are in bounds) and out-of-range entries are masked after. Measured: no gain over one serial run
// with its loads behind the slot's branch (run 135: the runs' loads are uncoalesced whichever way, which
// compose_range's strided loads fix); kept as run 136 verified it. Now only a range with an out-of-range slot takes it.
__device__ ChainElem compose_run(const WriteParams& p, i64 i0, i64 i1) {
    const i64 half = (i1 - i0 + 1) >> 1;
    const i64 num_slots = p.st.num_slots;
    const i64 w = p.entry_wide;
    u64 b0 = 0, b1 = 0, pos0 = 0, pos1 = 0;
    i64 c0 = 0, c1 = 0;
#pragma unroll 1  // the rare path (a range with a skipped entry); unrolled, it made the kernel spill
    for (i64 j = 0; j < half; ++j) {
        const i64 ia = i0 + j, ib = i0 + half + j < i1 ? i0 + half + j : i0 + j;
        const i64 sa = load_int(p.out_cache_loc, w & ENTRY_WIDE_OUT_CACHE_LOC, ia);
        const i64 sb = load_int(p.out_cache_loc, w & ENTRY_WIDE_OUT_CACHE_LOC, ib);
        const u64 pa = (u64)load_int(p.positions, w & ENTRY_WIDE_POSITIONS, ia);
        const u64 pb = (u64)load_int(p.positions, w & ENTRY_WIDE_POSITIONS, ib);
        const u64 ta = (u64)load_int(p.input_ids, w & ENTRY_WIDE_INPUT_IDS, ia);
        const u64 tb = (u64)load_int(p.input_ids, w & ENTRY_WIDE_INPUT_IDS, ib);
        const bool ka = sa >= 0 && sa < num_slots;
        const bool kb = i0 + half + j < i1 && sb >= 0 && sb < num_slots;
        const u64 ga = chain_g(ta, pa), gb = chain_g(tb, pb);
        const u64 na = addmod_p(mulmod_p(CHAIN_MUL, b0), ga), nb = addmod_p(mulmod_p(CHAIN_MUL, b1), gb);
        b0 = ka ? na : b0;
        b1 = kb ? nb : b1;
        pos0 = ka ? pa : pos0;
        pos1 = kb ? pb : pos1;
        c0 += ka;
        c1 += kb;
    }
    ChainElem run = chain_identity();
    if (c0 + c1 > 0) {
        run.a = powmod_p(CHAIN_MUL, c0 + c1);
        run.b = addmod_p(mulmod_p(powmod_p(CHAIN_MUL, c1), b0), b1);
        run.pos = c1 > 0 ? pos1 : pos0;
        run.has = 1;
    }
    return run;
}

// The chain map of entries [i0, i1) of the write, composed by the whole block (every thread calls it). When every
// entry advances the chain (its slot in range: the usual case) the loads are coalesced: thread t takes entries
// i0 + t + 256 j. Every advancing entry multiplies by the same A, so entry i adds g_i A^(i1 - 1 - i): each thread
// runs Horner over its entries with A^256, scales the result by A^(i1 - 1 - its last entry), and one block scan
// sums the terms. When some entry does not advance, each thread composes a contiguous run (compose_run) and one
// block scan joins the runs. The contiguous runs alone read each warp's 32 entries 8 bytes per 32-byte sector,
// 256 threads apart: a 32k-token prefill's segments moved 4x the bytes of their inputs through L2 (runs 134-135).
__device__ ChainElem compose_range(const WriteParams& p, i64 i0, i64 i1, WriteShared& sh) {
    const int tid = threadIdx.x;
    const i64 w = p.entry_wide, num_slots = p.st.num_slots;
    const u64 step = powmod_p(CHAIN_MUL, WRITE_THREADS);
    u64 b = 0;
    i64 last = -1;
    int all = 1;
#pragma unroll 4
    for (i64 i = i0 + tid; i < i1; i += WRITE_THREADS) {
        const i64 slot = load_int(p.out_cache_loc, w & ENTRY_WIDE_OUT_CACHE_LOC, i);
        const u64 pos = (u64)load_int(p.positions, w & ENTRY_WIDE_POSITIONS, i);
        const u64 tok = (u64)load_int(p.input_ids, w & ENTRY_WIDE_INPUT_IDS, i);
        all &= slot >= 0 && slot < num_slots;
        b = addmod_p(mulmod_p(step, b), chain_g(tok, pos));
        last = i;
    }
    ChainElem total;
    if (__syncthreads_and(all)) {  // block-uniform
        const u64 term = last >= 0 ? mulmod_p(b, powmod_p(CHAIN_MUL, i1 - 1 - last)) : 0;
        block_scan(ChainElem{1ULL, term, 0ULL, 0}, &total, sh.warp);  // maps h -> h + term: the scan sums them
        if (i1 <= i0) return chain_identity();
        return ChainElem{powmod_p(CHAIN_MUL, i1 - i0), total.b,
                         (u64)load_int(p.positions, w & ENTRY_WIDE_POSITIONS, i1 - 1), 1};
    }
    const i64 per = (i1 - i0 + WRITE_THREADS - 1) / WRITE_THREADS;
    const i64 j0 = i0 + tid * per < i1 ? i0 + tid * per : i1;
    const i64 j1 = j0 + per < i1 ? j0 + per : i1;
    block_scan(compose_run(p, j0, j1), &total, sh.warp);
    return total;
}

// ---- The write's decoupled look-back (docs/records.md 8). Segment k of a request of several segments publishes
// its own chain map (AGG) as soon as it knows it, and the map of segments 0..k (INCL) once it has looked back;
// segment k then needs only its predecessors' maps, newest first, up to the first INCL: no segment composes the
// entries before it (the quadratic work of run 136: a 32k-token request's last segment read 127 x 256 entries).
// An item is LOOKBACK_ITEM_WORDS words: [0] flag, [1..3] AGG a, b, pos, [4..6] INCL a, b, pos, [7] the request's
// done counter (segment 0's item only). The flag is written last, after a fence; a reader that sees it fences
// before reading the values. The last segment of a request to finish clears its request's flags and counter, so
// every flag and counter is zero between launches with no epoch and no work for single-segment (decode) requests.
// A predecessor that does not publish within LOOKBACK_POLLS polls (not resident, beyond lookback_items) is
// composed from its entries instead (compose_range): the result never depends on timing, only the time does.
#define LB_AGG 1ULL
#define LB_INCL 2ULL
#define LB_HAS 4ULL
#define LOOKBACK_POLLS 64

__device__ __forceinline__ void lookback_publish(u64* item, const ChainElem& e, bool incl) {
    volatile u64* v = item;
    const int o = incl ? 4 : 1;
    v[o] = e.a;
    v[o + 1] = e.b;
    v[o + 2] = e.pos;
    __threadfence();
    v[0] = (incl ? LB_INCL : LB_AGG) | (e.has ? LB_HAS : 0ULL);
}

__device__ __forceinline__ ChainElem shfl_down_elem(const ChainElem& e, int d) {
    return ChainElem{__shfl_down_sync(0xffffffffu, e.a, d), __shfl_down_sync(0xffffffffu, e.b, d),
                     __shfl_down_sync(0xffffffffu, e.pos, d), __shfl_down_sync(0xffffffffu, e.has, d)};
}

// The map of segments 0..k-1 of request r (segments of L entries from `start`), for the whole block (every thread
// calls it). Warp 0 reads 32 predecessors at a time, lane l taking segment j - l; the AGGs before the first INCL
// (or unavailable item) are joined by a shuffle reduction, the older lanes first.
__device__ ChainElem look_back(const WriteParams& p, i64 r, i64 k, i64 nreq, i64 start, i64 L, WriteShared& sh) {
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        ChainElem acc = chain_identity();  // segments j + 1 .. k - 1
        i64 fallback_end = -1;
        for (i64 j = k - 1;; j -= 32) {
            const i64 idx = j - lane;
            u64 f = LB_INCL;  // before segment 0: the identity, never reached (segment 0 is INCL or unavailable)
            ChainElem v = chain_identity();
            if (idx >= 0) {
                const i64 w = idx * nreq + r;
                f = 0;
                if (w < p.lookback_items) {
                    const volatile u64* it = p.lookback + w * LOOKBACK_ITEM_WORDS;
                    f = it[0];
                    for (int t = 0; f == 0 && t < LOOKBACK_POLLS; ++t) {
                        __nanosleep(32);
                        f = it[0];
                    }
                    if (f) {
                        __threadfence();
                        const int o = (f & LB_INCL) ? 4 : 1;
                        v = ChainElem{it[o], it[o + 1], it[o + 2], (f & LB_HAS) ? 1 : 0};
                    }
                }
            }
            const unsigned int stop = __ballot_sync(0xffffffffu, (f & LB_AGG) == 0);  // INCL, or unavailable
            const int s = stop ? __ffs(stop) - 1 : 32;
            if (lane > s || (lane == s && (f & LB_INCL) == 0)) v = chain_identity();
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const ChainElem o = shfl_down_elem(v, d);  // lane + d is the older segment
                if (lane + d < 32) v = combine(o, v);
            }
            v = ChainElem{__shfl_sync(0xffffffffu, v.a, 0), __shfl_sync(0xffffffffu, v.b, 0),
                          __shfl_sync(0xffffffffu, v.pos, 0), __shfl_sync(0xffffffffu, v.has, 0)};
            acc = combine(v, acc);
            if (s < 32) {
                if ((__shfl_sync(0xffffffffu, f, s) & LB_INCL) == 0) fallback_end = start + (j - s + 1) * L;
                break;
            }
        }
        if (lane == 0) {
            sh.lb = acc;
            sh.lb_end = fallback_end;
        }
    }
    __syncthreads();
    ChainElem acc = sh.lb;
    const i64 fallback_end = sh.lb_end;
    if (fallback_end >= 0) acc = combine(compose_range(p, start, fallback_end, sh), acc);  // block-uniform
    return acc;
}

// One write entry's inputs; *e gets its chain map (identity unless its slot is in range). The real-KV fold is
// left to the caller when `fold` is false (a segment that publishes its map first: the fold is most of its time).
struct WriteEntry {
    i64 slot;
    u64 tok, pos, et, ep, kvh;
};

__device__ __forceinline__ WriteEntry load_entry(const WriteParams& p, i64 i, i64 hi, ChainElem* e, bool fold) {
    WriteEntry x{-1, 0, 0, ~0ULL, ~0ULL, 0};
    *e = chain_identity();
    if (i < hi) {
        x.slot = load_int(p.out_cache_loc, p.entry_wide & ENTRY_WIDE_OUT_CACHE_LOC, i);
        x.tok = (u64)load_int(p.input_ids, p.entry_wide & ENTRY_WIDE_INPUT_IDS, i);
        x.pos = (u64)load_int(p.positions, p.entry_wide & ENTRY_WIDE_POSITIONS, i);
        if (p.expected_input_ids)
            x.et = (u64)load_int(p.expected_input_ids, p.entry_wide & ENTRY_WIDE_EXPECTED_INPUT_IDS, i);
        if (p.expected_positions)
            x.ep = (u64)load_int(p.expected_positions, p.entry_wide & ENTRY_WIDE_EXPECTED_POSITIONS, i);
        if (x.slot >= 0 && x.slot < p.st.num_slots) {  // out-of-range entries neither store nor advance the chain
            if (fold) x.kvh = fold_slot(p.kv, x.slot);
            *e = ChainElem{CHAIN_MUL, chain_g(x.tok, x.pos), x.pos, 1};
        }
    }
    return x;
}

// Checks, reports and (when `last`) stores one entry of slot >= 0, given its exclusive chain prefix `ex` within
// the tile and the running hash h / last position before the tile.
__device__ __forceinline__ void finish_entry(const StateParams& st, const WriteEntry& x, const ChainElem& ex, u64 h,
                                             bool valid, u64 prev_pos, bool chain_on, bool last) {
    const bool stored = x.slot < st.num_slots;
    const u64 run = valid ? CHAIN_TAG | addmod_p(mulmod_p(ex.a, h), ex.b) : NOT_A_LINK;
    const u64 chain_exp = (ex.has ? ex.pos : prev_pos) + 1;
    u64 bits = stored ? 0 : FAIL_SLOT_RANGE;
    if (x.et != ~0ULL && x.tok != x.et) bits |= FAIL_WRITE_TOKEN;
    const bool arr_fail = x.ep != ~0ULL && x.pos != x.ep;
    const bool chain_fail = chain_on && x.pos != chain_exp;
    if (arr_fail || chain_fail) bits |= FAIL_WRITE_POSITION;
    const u64 aux = arr_fail ? x.ep : chain_fail ? chain_exp : x.ep != ~0ULL ? x.ep : chain_on ? chain_exp : ~0ULL;
    if (bits) append_row(st, (u64)x.slot, x.pos, x.tok, x.et, run, aux, bits);
    if (last) {
        u64* rec = reinterpret_cast<u64*>(st.canary + x.slot * st.slot_stride);
        rec[0] = x.tok;
        rec[1] = x.pos;
        rec[2] = run;
        rec[3] = x.kvh;
    }
}

// The running hash and last position before a request's first entry: link(seed) and the seed's position, or the
// anchor and "none" (-1, so that position 0 is expected first) without a seed. `valid` is false when the seed's
// record holds no chain value.
__device__ __forceinline__ void read_seed(const WriteParams& p, i64 r, u64* h, bool* valid, u64* prev_pos) {
    *h = ANCHOR_LINK & FIELD_P;
    *valid = true;
    *prev_pos = ~0ULL;
    const i64 seed = p.write_seed_slot_indices[r];
    if (seed >= 0 && seed < p.st.num_slots) {
        const u64* rec = slot_record(p.st, seed);
        *valid = chain_field(chain_link(rec[2], rec[0], rec[1]), h);
        *prev_pos = rec[1];
    }
}

// A request of at most 32 entries by warp 0 alone: no barrier, no shared memory. The warp's shuffles scan the
// chain maps; __match_any_sync finds a slot's last occurrence. The seed is read before the __syncwarp that
// orders it ahead of every lane's store.
__device__ void write_warp(const WriteParams& p, i64 r, i64 lo, i64 hi, bool chain_on, unsigned long long& processed) {
    const StateParams& st = p.st;
    const int lane = threadIdx.x;
    u64 h, prev_pos;
    bool valid;
    read_seed(p, r, &h, &valid, &prev_pos);
    const i64 i = lo + lane;
    ChainElem e;
    const WriteEntry x = load_entry(p, i, hi, &e, true);
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const ChainElem o = shfl_up_elem(e, d);
        if (lane >= d) e = combine(o, e);
    }
    const ChainElem up = shfl_up_elem(e, 1);
    const ChainElem ex = lane > 0 ? up : chain_identity();
    const unsigned int same = __match_any_sync(0xffffffffu, x.slot);
    __syncwarp();
    if (i < hi && x.slot >= 0) {
        ++processed;
        const bool last = x.slot < st.num_slots && (same >> lane >> 1) == 0;
        finish_entry(st, x, ex, h, valid, prev_pos, chain_on, last);
    }
}

// Segment k's prefix, the map of segments 0..k-1 (from the look-back, or composed from their entries [start, lo)
// without one), applied to the running hash h and the last position; published as the segment's INCL, with its
// own map `own` after it, when the segment has an item. Every thread calls it.
__device__ __forceinline__ void take_prefix(const WriteParams& p, i64 r, i64 k, i64 nreq, i64 start, i64 lo, i64 L,
                                            bool lb_on, u64* item, const ChainElem& own, WriteShared& sh, u64& h,
                                            u64& prev_pos) {
    const ChainElem pre = lb_on ? look_back(p, r, k, nreq, start, L, sh) : compose_range(p, start, lo, sh);
    if (item && threadIdx.x == 0) lookback_publish(item, combine(pre, own), true);
    h = addmod_p(mulmod_p(pre.a, h), pre.b);
    if (pre.has) prev_pos = pre.pos;
}

// Segment k of request r (nreq requests), by the whole block. The running hash before the segment is link(seed)
// carried through the map of segments 0..k-1: read from the look-back scratch, or composed from their entries
// (compose_range) without one. Per tile of WRITE_THREADS entries: every thread stages its entry, one block scan
// gives each entry its running hash and expected chain position, and every thread checks, reports and stores its
// own entry. A slot that appears again later in the same tile is stored only by its last occurrence; tiles are
// ordered by barriers. A one-tile segment publishes its map from that tile's scan, before its real-KV folds and
// before it waits for its predecessors; a longer one composes its own entries first.
__device__ void write_segment(const WriteParams& p, i64 r, i64 k, i64 nreq, WriteShared& sh,
                              unsigned long long& processed) {
    const StateParams& st = p.st;
    const int tid = threadIdx.x;
    const i64 n = p.num_entries;
    const i64 start = clamp64(p.write_offsets[r], 0, n);
    const i64 end = clamp64(p.write_offsets[r + 1], 0, n);
    const i64 L = segment_len(end - start);
    const i64 lo = start + k * L;
    const i64 hi = lo + L < end ? lo + L : end;
    const bool chain_on = (*st.check_flags & CHECK_WRITE_POSITION_CHAIN) != 0;
    if (lo == start && hi - lo <= 32) {  // block-uniform: a request of one warp's entries (decode) takes warp 0
        if (tid < 32) write_warp(p, r, lo, hi, chain_on, processed);
        return;
    }
    // Everything below is block-uniform. Items exist for requests r < lookback_items (segment 0's item holds the
    // done counter); a segment beyond lookback_items still looks back, and its successors compose it.
    const i64 nseg = (end - start + L - 1) / L;
    const bool lb_on = p.lookback != nullptr && nseg > 1 && r < p.lookback_items;
    const i64 w = k * nreq + r;
    u64* const item = lb_on && k + 1 < nseg && w < p.lookback_items ? p.lookback + w * LOOKBACK_ITEM_WORDS : nullptr;
    const bool one_tile = hi - lo <= WRITE_THREADS;

    u64 h, prev_pos;  // read by every thread before any store of this segment (the first scan's barrier orders them)
    bool valid;
    read_seed(p, r, &h, &valid, &prev_pos);
    bool pending = k > 0;  // the map of segments 0..k-1 is still to be applied to h
    if (!one_tile) {
        ChainElem own = chain_identity();
        if (item) own = compose_range(p, lo, hi, sh);
        if (item && tid == 0) lookback_publish(item, own, k == 0);
        if (pending) take_prefix(p, r, k, nreq, start, lo, L, lb_on, item, own, sh, h, prev_pos);
        pending = false;
    }
    for (i64 base = lo; base < hi; base += WRITE_THREADS) {
        const i64 i = base + tid;
        const bool dedup = hi - base > 1;
        if (dedup) {  // the previous tile's lookups are behind the loop's closing barrier
            sh.key[tid] = sh.key[tid + WRITE_THREADS] = DEDUP_EMPTY;
            sh.owner[tid] = sh.owner[tid + WRITE_THREADS] = -1;
        }
        ChainElem e;
        WriteEntry x = load_entry(p, i, hi, &e, !pending);
        if (dedup) {
            __syncthreads();  // the table is clear
            if (x.slot >= 0 && x.slot < st.num_slots) dedup_insert(sh, x.slot, tid);
        }
        ChainElem total;
        const ChainElem ex = block_scan(e, &total, sh.warp);  // its barriers publish the table too
        if (item && one_tile && tid == 0) lookback_publish(item, total, k == 0);
        if (pending) {  // a one-tile segment after the first
            take_prefix(p, r, k, nreq, start, lo, L, lb_on, item, total, sh, h, prev_pos);
            pending = false;
            if (x.slot >= 0 && x.slot < st.num_slots) x.kvh = fold_slot(p.kv, x.slot);
        }
        if (i < hi && x.slot >= 0) {
            ++processed;
            const bool last = x.slot < st.num_slots && (!dedup || dedup_last(sh, x.slot, tid));
            finish_entry(st, x, ex, h, valid, prev_pos, chain_on, last);
        }
        h = addmod_p(mulmod_p(total.a, h), total.b);
        if (total.has) prev_pos = total.pos;
        __syncthreads();  // the next tile reuses the table
    }
    if (lb_on) {  // this segment's reads and publications are done: count it; the request's last one clears
        if (tid == 0) {
            __threadfence();
            u64* done = p.lookback + r * LOOKBACK_ITEM_WORDS + 7;
            sh.lb_last = atomicAdd(reinterpret_cast<unsigned long long*>(done), 1ULL) == (unsigned long long)(nseg - 1);
        }
        __syncthreads();
        if (sh.lb_last) {
            __threadfence();  // acquire: every segment's flag stores (before its fenced increment) precede the clear
            for (i64 q = tid; q < nseg; q += WRITE_THREADS)
                if (q * nreq + r < p.lookback_items) p.lookback[(q * nreq + r) * LOOKBACK_ITEM_WORDS] = 0;
            if (tid == 0) p.lookback[r * LOOKBACK_ITEM_WORDS + 7] = 0;
        }
        __syncthreads();  // sh.lb_last is rewritten by the next segment
    }
}

// Work items w = k * nreq + r (segment k of request r), over a grid of any size: block b takes the items
// w = b (mod gridDim.x), WRITE_THREADS candidates at a time; the non-empty ones (a request not seeded
// CANARY_SKIP_SEED, k below its segment count) are queued in shared memory in increasing w and run one after the
// other. A long request spreads over up to WRITE_MAX_SEGMENTS blocks (SMs), and its real-KV folds with it.
// Segment-major order (every request's first segment first) spreads decode's one-segment requests over the blocks
// (request-major put 32 of them on each 32nd block, serially: run 46); increasing w in every block means a
// segment's predecessors were started before it wherever the grid is resident, so look-back waits end.
extern "C" __global__ void __launch_bounds__(WRITE_THREADS, WRITE_MIN_BLOCKS) canary_write(const WriteParams p) {
    __shared__ WriteShared sh;
    __shared__ i64 s_items[WRITE_THREADS];
    __shared__ int s_count[WRITE_WARPS];
    __shared__ unsigned long long s_processed;
    const StateParams& st = p.st;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (blockIdx.x == 0 && tid == 0) atomicAdd(&st.kernel_run_counter[COUNTER_WRITE], 1ULL);
    if (tid == 0) s_processed = 0;
    const i64 nreq = clamp64((i64)*p.write_num_valid_reqs, 0, p.write_req_capacity);
    const i64 n = p.num_entries;
    const i64 items = nreq * WRITE_MAX_SEGMENTS;
    const i64 grid = gridDim.x;
    unsigned long long processed = 0;
    for (i64 c = 0; c * grid + blockIdx.x < items; c += WRITE_THREADS) {  // block-uniform
        const i64 w = (c + tid) * grid + blockIdx.x;
        bool want = false;
        if (w < items) {
            const i64 r = w % nreq, k = w / nreq;
            if (p.write_seed_slot_indices[r] != CANARY_SKIP_SEED) {  // a padding row's tokens: nothing of them is looked at
                const i64 len = clamp64(p.write_offsets[r + 1], 0, n) - clamp64(p.write_offsets[r], 0, n);
                want = len > 0 && k * segment_len(len) < len;
            }
        }
        const unsigned int mine = __ballot_sync(0xffffffffu, want);
        if (lane == 0) s_count[warp] = __popc(mine);
        __syncthreads();
        int before = 0, m = 0;
#pragma unroll
        for (int q = 0; q < WRITE_WARPS; ++q) {
            before += q < warp ? s_count[q] : 0;
            m += s_count[q];
        }
        if (want) s_items[before + __popc(mine & ((1u << lane) - 1u))] = w;
        __syncthreads();
        for (int q = 0; q < m; ++q) {
            const i64 w2 = s_items[q];
            write_segment(p, w2 % nreq, w2 / nreq, nreq, sh, processed);
        }
        __syncthreads();  // s_items and s_count are rewritten next round
    }
    add_block_count(&s_processed, processed, &st.slot_run_counter[COUNTER_WRITE]);
}

// One thread per entry (grid-stride over [0, verify_capacity)); processed entries are summed per block.
extern "C" __global__ void __launch_bounds__(VERIFY_THREADS) canary_verify(const VerifyParams p) {
    __shared__ unsigned long long s_processed;
    const StateParams& st = p.st;
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(&st.kernel_run_counter[COUNTER_VERIFY], 1ULL);
    if (*p.enable == 0) return;  // the same word for every thread: the whole grid leaves together
    if (threadIdx.x == 0) s_processed = 0;
    __syncthreads();
    const i64 n = clamp64((i64)*p.verify_num_valid, 0, p.verify_capacity);
    const bool token_on = (*st.check_flags & CHECK_VERIFY_TOKEN) != 0;
    unsigned long long processed = 0;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 slot = p.verify_slot_indices[i];
        if (!CANARY_PADDING_NEG && slot == 0) continue;  // padding
        ++processed;
        const u64 ep = (u64)p.verify_expected_positions[i];
        const u64 et = (u64)p.verify_expected_tokens[i];
        if (slot < 0 || slot >= st.num_slots) {
            // A MISSING row's expected_aux is the entry's predecessor slot: nothing is read, and it names the request
            if (slot == CANARY_MISSING_SLOT) {
                const i64 prev = p.verify_prev_slot_indices[i];
                if (!reported(st, prev, 2)) append_row(st, (u64)slot, ep, 0, et, 0, (u64)prev, FAIL_MISSING);
            } else {
                append_row(st, (u64)slot, ep, 0, et, 0, 0, FAIL_SLOT_RANGE);
            }
            continue;
        }
        const i64 prev = p.verify_prev_slot_indices[i];
        const u64* rec = slot_record(st, slot);
        const u64 tok = rec[0], pos = rec[1], hash = rec[2], kvh = rec[3];
        u64 bits = 0, expected = 0;
        bool checked = true;
        if (prev == -1) {
            expected = ANCHOR_LINK;
        } else if (prev >= FIRST_SLOT && prev < st.num_slots) {
            const u64* prec = slot_record(st, prev);
            expected = chain_link(prec[2], prec[0], prec[1]);
        } else {
            checked = false;  // NO_LINK: the predecessor page was freed (SWA); anything else is out of range
            if (prev != NO_LINK) bits |= FAIL_SLOT_RANGE;
        }
        if (checked && hash != expected) bits |= FAIL_CHAIN;
        if (pos != ep) bits |= FAIL_POSITION;
        if (token_on && et != ~0ULL && tok != et) bits |= FAIL_VERIFY_TOKEN;
        if (p.kv.num_sources > 0 && kvh != fold_slot(p.kv, slot)) bits |= FAIL_REAL_KV;
        if (bits && !reported(st, slot, 1)) append_row(st, (u64)slot, ep, tok, et, hash, expected, bits);
    }
    add_block_count(&s_processed, processed, &st.slot_run_counter[COUNTER_VERIFY]);
}

// One block per batch row; threads stride over the row's tokens. Columns outside the pool are skipped.
template <typename Token>
__device__ void scatter(const ScatterParams& p) {
    const i64 r = blockIdx.x;
    if (r >= p.bs) return;
    const i64 rp = p.req_pool_indices[r];
    if (rp <= 0 || rp >= p.pool_rows) return;  // 0: padding row
    const i64 start = clamp64(p.token_offsets[r], 0, p.num_tokens);
    const i64 end = clamp64(p.token_offsets[r + 1], 0, p.num_tokens);
    // Column arithmetic in u64: wraparound is the reference's int64 wraparound, without signed overflow.
    const u64 col0 = (u64)p.column_starts[r] + (u64)p.column_offset;
    const Token* tokens = static_cast<const Token*>(p.tokens);
    int* row = p.pool + rp * p.pool_row_stride;
    for (i64 j = threadIdx.x; j < end - start; j += blockDim.x) {
        const i64 col = (i64)(col0 + (u64)j);
        if (col >= 0 && col < p.pool_cols) row[col] = (int)tokens[start + j];
    }
}

extern "C" __global__ void __launch_bounds__(SCATTER_THREADS) canary_scatter_i64(const ScatterParams p) {
    scatter<i64>(p);
}

extern "C" __global__ void __launch_bounds__(SCATTER_THREADS) canary_scatter_i32(const ScatterParams p) {
    scatter<int>(p);
}

// A decode batch's accepted tokens, read from the engine's device array: row r's token goes to pool row q[r] at
// column valid[r], and valid[r] counts it, so that the plan launched next reads the new valid lengths with no
// host-to-device copy (the manager's accept_tokens_batch with device token ids, canary/manager/staging.py). Not
// idempotent (it advances valid): the manager launches it once per accept. One thread a row; a row outside the
// pool or a full row is skipped and keeps its length (the manager refuses both on the host first). CuPy backend
// only, like report.cu: a Numba manager copies device tokens to the host instead. Reference: docs/records.md 7.
// AppendParams: canary_constants.cuh.
template <typename Token>
__device__ void append_tokens(const AppendParams& p) {
    const i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= p.n) return;
    const i64 rp = p.q[r];
    const i64 col = p.valid[r];
    if (rp <= 0 || rp >= p.pool_rows || col < 0 || col >= p.pool_cols) return;
    p.pool[rp * p.pool_row_stride + col] = (int)static_cast<const Token*>(p.tokens)[r];
    p.valid[r] = col + 1;
}

extern "C" __global__ void __launch_bounds__(SCATTER_THREADS) canary_append_tokens_i64(const AppendParams p) {
    append_tokens<i64>(p);
}

extern "C" __global__ void __launch_bounds__(SCATTER_THREADS) canary_append_tokens_i32(const AppendParams p) {
    append_tokens<int>(p);
}

// ---- The layer rotation (docs/records.md 10; host: canary/records/layers.py; reference:
// canary/backends/reference/layers.py). A side table layer_hashes[num_slots, num_layers] holds every layer's
// real-KV fold of each slot (fold_slot above, unchanged, over that layer's sources); write_layers refreshes the
// table for the step's written slots and advances the device cursor, verify_layer checks one layer a step.
// LAYER_THREADS, LAYER_KIND_SHIFT and LayerParams: canary_constants.cuh.

// A corrupt cursor (outside [0, num_layers)) reads as layer 0, in both kernels and the reference.
__device__ __forceinline__ i64 cursor_layer(const LayerParams& p) {
    const i64 c = (i64)p.layer_cursor[0];
    return (c >= 0 && c < p.num_layers) ? c : 0;
}

__device__ __forceinline__ u64 fold_layer(const LayerParams& p, i64 layer, i64 slot) {
    RealKVParams kv = p.kv;
#pragma unroll
    for (int s = 0; s < MAX_SOURCES; ++s)
        if (s < kv.num_sources) kv.base[s] = reinterpret_cast<const unsigned char*>(p.layer_bases[layer * kv.num_sources + s]);
    return fold_slot(kv, slot);
}

// The request owning entry i: the last r < nreq with clamp(write_offsets[r], 0, N) <= i (-1: none), by binary
// search. The planner's offsets never decrease, so this is the request whose range the write kernel gives i;
// the reference runs this very search, so garbage offsets give the same answer everywhere.
__device__ __forceinline__ i64 owner_of(const LayerParams& p, i64 nreq, i64 i) {
    i64 lo = 0, hi = nreq;
    while (lo < hi) {
        const i64 mid = (lo + hi) >> 1;
        if (clamp64(p.write_offsets[mid], 0, p.num_entries) <= i) lo = mid + 1; else hi = mid;
    }
    return lo - 1;
}

// Grid-stride over (entry, layer) pairs of the step's new tokens: every layer of every slot the write kernel
// stores (same request ranges, CANARY_SKIP_SEED and slot rules) is folded into the table. Two entries naming one slot
// store the same hashes. Thread 0 advances the cursor: this launch follows the step's verify_layer on the
// stream and reads no cursor itself, so no read of this step can see the new value.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS) canary_write_layers(const LayerParams p) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        i64 layer = cursor_layer(p);
        i64 spent = (i64)p.layer_cursor[1] + 1;
        if (spent >= p.dwell || spent < 1) {
            layer = (layer + 1) % p.num_layers;
            spent = 0;
        }
        p.layer_cursor[0] = (int)layer;
        p.layer_cursor[1] = (int)spent;
    }
    const i64 n = p.num_entries;
    const i64 nreq = clamp64((i64)*p.write_num_valid_reqs, 0, p.write_req_capacity);
    const i64 total = n * p.num_layers;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < total; j += (i64)gridDim.x * blockDim.x) {
        const i64 i = j / p.num_layers, layer = j % p.num_layers;
        const i64 r = owner_of(p, nreq, i);
        if (r < 0 || i >= clamp64(p.write_offsets[r + 1], 0, n) || p.write_seed_slot_indices[r] == CANARY_SKIP_SEED) continue;
        const i64 slot = load_int(p.out_cache_loc, p.entry_wide & ENTRY_WIDE_OUT_CACHE_LOC, i);
        if (slot < 0 || slot >= p.st.num_slots) continue;
        p.layer_hashes[slot * p.num_layers + layer] = (i64)fold_layer(p, layer, slot);
    }
}

// One thread per verify entry (grid-stride), verify's skip rules: enable, padding slot 0, MISSING / out-of-range
// slots (verify reports those). Layer cursor_layer's fold of each slot against the table; counted in the verify
// counters like verify.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS) canary_verify_layer(const LayerParams p) {
    __shared__ unsigned long long s_processed;
    const StateParams& st = p.st;
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(&st.kernel_run_counter[COUNTER_VERIFY], 1ULL);
    if (*p.enable == 0) return;
    if (threadIdx.x == 0) s_processed = 0;
    __syncthreads();
    const i64 n = clamp64((i64)*p.verify_num_valid, 0, p.verify_capacity);
    const i64 layer = cursor_layer(p);
    unsigned long long processed = 0;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 slot = p.verify_slot_indices[i];
        if (!CANARY_PADDING_NEG && slot == 0) continue;
        ++processed;
        if (slot < 0 || slot >= st.num_slots) continue;
        const u64 stored = (u64)p.layer_hashes[slot * p.num_layers + layer];
        const u64 fresh = fold_layer(p, layer, slot);
        if (stored != fresh && !reported(st, slot, 1)) {
            StateParams rs = st;
            rs.tag = st.tag | (layer << LAYER_KIND_SHIFT);
            append_row(rs, (u64)slot, (u64)p.verify_expected_positions[i], slot_record(st, slot)[0],
                       (u64)p.verify_expected_tokens[i], stored, fresh, FAIL_REAL_KV);
        }
    }
    add_block_count(&s_processed, processed, &st.slot_run_counter[COUNTER_VERIFY]);
}
