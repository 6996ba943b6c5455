// kv-canary block digest of KV bytes in flight (SPEC 4.2, docs/records.md 12), compiled by NVRTC through CuPy.
// Numba twin: digest_numba.py. NumPy reference: canary/backends/reference/digest.py.
//
// A block's digest is the sum mod 2^64 of s(w ^ lane_key) over its lanes (8-byte words of a head), the key made
// from the lane's layer, kind, head, position and index. A sum does not care in which order lanes are added, so
// the grid splits a block's lanes any way it likes and atomics combine the shares: the result is the same bits
// whatever the schedule.
//
// One launch, graph-capturable: work items (block, layer, kind, split) are taken by the grid's blocks in turn; each
// adds its block-reduced share to the scratch's sum of its block (one atomic). The last block of the grid to finish
// (a counter in the scratch) writes every block's digest (compute) or its mismatch byte and the count (check) and
// zeroes the scratch again, so the next launch finds it as this one did. DigestParams: canary_constants.cuh.

#include "canary_constants.cuh"
#include "canary_ints.cuh"

#define DIGEST_WARPS (DIGEST_THREADS / 32)
#define DIGEST_MIN_BLOCKS 2  // resident blocks per SM the register budget must allow (104 registers at sm_90 today)

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

// head_key(l, k, h) = mix3(DIGEST_ANCHOR, 2 l + k, h) = s(s(DIGEST_KEY0 ^ (2 l + k)) ^ h).
__device__ __forceinline__ u64 head_key(u64 layer_kind, u64 head) {
    return splitmix64(splitmix64(DIGEST_KEY0 ^ layer_kind) ^ head);
}

struct DigestShared {
    u64 keys[DIGEST_MAX_HEADS];  // the item's head keys
    u64 warp[DIGEST_WARPS];
    int last;
};

// The block's wrapping sum of one value per thread, in thread 0 (every thread calls it; it ends on a barrier, so
// what the threads read from shared memory before the call may be rewritten after it).
__device__ u64 block_sum(u64 v, DigestShared& sh) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    if ((threadIdx.x & 31) == 0) sh.warp[threadIdx.x >> 5] = v;
    __syncthreads();
    u64 t = 0;
    if (threadIdx.x == 0)
        for (int w = 0; w < DIGEST_WARPS; ++w) t += sh.warp[w];
    __syncthreads();
    return t;
}

// A thread's place among an item's units u = (j * H + h) * V + v (token j, head h, 16-byte vector v), and the
// same radix for the stride between its units: the walk adds digits with carries instead of dividing per unit.
struct UnitStep {
    int dv, dh, djo;  // digits below a head, a token, an in-page offset: 32 bits, fewer registers
    i64 dj, djp;
};

__device__ __forceinline__ UnitStep unit_step(i64 stride, i64 V, i64 H, i64 S) {
    const i64 dr = stride / V, dj = dr / H;
    return UnitStep{(int)(stride % V), (int)(dr % H), (int)(dj % S), dj, dj / S};
}

// One share of item (block b, layer l, kind k): the sum of this thread's lanes; a page entry outside
// [0, num_pages) is not read and sets bad. Loads are 16 bytes (a head's bytes, base and strides are multiples of
// 16); DIGEST_UNROLL of them are issued before any is hashed.
__device__ __forceinline__ u64 digest_share(const DigestParams& p, const DigestShared& sh, int k, i64 l, i64 lo,
                                            i64 n, u64 pos0, i64 split, const UnitStep st, bool& bad) {
    const int H = (int)p.heads[k], V = (int)p.head_vecs[k], S = (int)p.page_size;
    const unsigned char* base = reinterpret_cast<const unsigned char*>(p.layer_bases[l * p.num_kinds + k]);
    const i64 ps = p.page_stride[k], ts = p.token_stride[k], hs = p.head_stride[k];
    const i64 idx_wide = p.index_wide & DIGEST_WIDE_KV_INDICES;
    const i64 u0 = split * DIGEST_THREADS + threadIdx.x;
    int v = (int)(u0 % V), h = (int)((u0 / V) % H);
    i64 j = u0 / V / H;
    int jo = (int)(j % S);
    i64 jp = j / S;
    u64 acc = 0;
    while (j < n) {
        ulonglong2 w[DIGEST_UNROLL];
        u64 key[DIGEST_UNROLL];
        bool live[DIGEST_UNROLL];
#pragma unroll
        for (int q = 0; q < DIGEST_UNROLL; ++q) {
            live[q] = false;
            if (j < n) {
                const i64 page = load_int(p.kv_indices, idx_wide, lo + jp);
                if (page >= 0 && page < p.num_pages) {
                    w[q] = reinterpret_cast<const ulonglong2*>(base + page * ps + jo * ts + h * hs)[v];
                    key[q] = sh.keys[h] + (((pos0 + (u64)j) << DIGEST_LANE_BITS) + 2 * (u64)v) * DIGEST_LANE_MUL;
                    live[q] = true;
                } else {
                    bad = true;
                }
                v += st.dv;
                int c = 0;
                if (v >= V) { v -= V; c = 1; }
                h += st.dh + c;
                c = 0;
                if (h >= H) { h -= H; c = 1; }
                j += st.dj + c;
                jo += st.djo + c;
                if (jo >= S) { jo -= S; jp += 1; }
                jp += st.djp;
            }
        }
#pragma unroll
        for (int q = 0; q < DIGEST_UNROLL; ++q)
            if (live[q]) acc += splitmix64(w[q].x ^ key[q]) + splitmix64(w[q].y ^ (key[q] + DIGEST_LANE_MUL));
    }
    return acc;
}

template <bool CHECK>
__device__ void digest(const DigestParams& p) {
    __shared__ DigestShared sh;
    const int tid = threadIdx.x;
    u64* acc = p.scratch + DIGEST_SCRATCH_HEAD_WORDS;
    u64* stat = acc + p.scratch_blocks;
    const i64 kinds = p.num_kinds, L = p.num_layers, S = p.page_size, splits = p.splits;
    const i64 items = p.num_blocks * L * kinds * splits;
    // The stride's digits per kind (DIGEST_MAX_KINDS = 2), in registers: an indexed local array would live in memory.
    const UnitStep step0 = unit_step(splits * DIGEST_THREADS, p.head_vecs[0], p.heads[0], S);
    const UnitStep step1 = kinds > 1 ? unit_step(splits * DIGEST_THREADS, p.head_vecs[1], p.heads[1], S) : step0;
    for (i64 w = blockIdx.x; w < items; w += gridDim.x) {  // every value below is the same for the whole block
        const i64 split = w % splits;
        i64 t = w / splits;
        const int k = (int)(t % kinds);
        t /= kinds;
        const i64 l = t % L, b = t / L;
        const i64 lo = load_int(p.kv_indptr, p.index_wide & DIGEST_WIDE_KV_INDPTR, b);
        const i64 hi = load_int(p.kv_indptr, p.index_wide & DIGEST_WIDE_KV_INDPTR, b + 1);
        bool ok = lo >= 0 && hi >= lo && hi <= p.nnz;
        const i64 cap = ok ? (hi - lo) * S : 0;
        const i64 n = p.block_lens ? load_int(p.block_lens, p.index_wide & DIGEST_WIDE_BLOCK_LENS, b) : cap;
        ok = ok && n >= 0 && n <= cap;
        if (!ok) {
            if (tid == 0 && w % (L * kinds * splits) == 0) atomicOr(&stat[b], (u64)DIGEST_BAD_RANGE);
            continue;
        }
        if (n == 0) continue;
        const u64 layer_kind = 2 * (u64)(p.layer_offset + l) + (u64)k;
        for (i64 h = tid; h < p.heads[k]; h += DIGEST_THREADS)
            sh.keys[h] = head_key(layer_kind, (u64)(p.head_offset + h));
        __syncthreads();
        const u64 pos0 = (u64)load_int(p.block_positions, p.index_wide & DIGEST_WIDE_BLOCK_POSITIONS, b);
        bool bad = false;
        const u64 sum = digest_share(p, sh, k, l, lo, n, pos0, split, k == 0 ? step0 : step1, bad);
        if (bad) atomicOr(&stat[b], (u64)DIGEST_BAD_PAGE);
        const u64 total = block_sum(sum, sh);  // its barriers also end this item's reads of sh.keys
        if (tid == 0 && total != 0) atomicAdd(&acc[b], total);
    }

    // The last block of the grid: every other block's atomics are done and visible (each fenced before counting).
    __threadfence();
    __syncthreads();
    if (tid == 0) sh.last = atomicAdd(&p.scratch[0], 1ULL) == (u64)gridDim.x - 1;
    __syncthreads();
    if (!sh.last) return;
    __threadfence();
    u64 flagged = 0;
    for (i64 b = tid; b < p.num_blocks; b += DIGEST_THREADS) {
        const u64 a = atomicExch(&acc[b], 0ULL);  // read and re-armed for the next launch
        const u64 st = atomicExch(&stat[b], 0ULL);
        const u64 d = st ? BAD_DIGEST : a;
        if (CHECK) {
            const u64 e = p.expected[b];
            const u64 f = st | (d != e ? DIGEST_DIFFERS : 0) | (e == BAD_DIGEST ? DIGEST_EXPECTED_BAD : 0);
            p.mismatch[b] = (unsigned char)f;
            flagged += f != 0;
        } else {
            p.out[b] = d;
            if (p.status_out) p.status_out[b] = (unsigned char)st;
        }
    }
    if (CHECK) {
        const u64 count = block_sum(flagged, sh);
        if (tid == 0) {
            if (p.index_wide & DIGEST_WIDE_COUNT_OUT) *static_cast<i64*>(p.count_out) = (i64)count;
            else *static_cast<int*>(p.count_out) = (int)count;
        }
    }
    if (tid == 0) atomicExch(&p.scratch[0], 0ULL);
}

extern "C" __global__ void __launch_bounds__(DIGEST_THREADS, DIGEST_MIN_BLOCKS)
canary_digest(const DigestParams p) {
    digest<false>(p);
}

extern "C" __global__ void __launch_bounds__(DIGEST_THREADS, DIGEST_MIN_BLOCKS)
canary_digest_check(const DigestParams p) {
    digest<true>(p);
}
