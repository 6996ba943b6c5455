// The ranks' agreement words of a GPU manager (SPEC 4.3, canary/manager/distributed.py), compiled by NVRTC through
// CuPy. Numba twin: agree_numba.py. The host formula (distributed.py entries_digest / plan_digest) is the
// reference: the words are the same bits.
//
// One launch per group and step, after the group's write, on the manager's stream (inside its captured step
// graphs too). Per group two words of the report block, cleared behind every report:
//   plan    += sum over i < clamp(plan_num_valid, 0, plan_capacity) of
//              mix3(slot_i mod 2^63, token_i, position_i ^ AGREE_PLAN_SALT)   (a MISSING_SLOT entry counts too)
//   entries += sum over i < n with slot_i >= 0 of mix3(slot_i, token_i, position_i ^ AGREE_ENTRY_SALT)
// with mix3(a, b, c) = s(s(s(a) ^ b) ^ c), s = splitmix64, sums mod 2^64 (the host drops the top bit when it
// reads them). A wrapping sum does not care in which order terms are added: each block adds its block-reduced
// share with one atomic per word, and the result is the same bits whatever the grid or the schedule. The grid
// comes from n and plan_capacity (agree_layout.py agree_grid); the plan's valid count is read here, so a captured
// launch stays right for every replay.

#include "canary_constants.cuh"
#include "canary_ints.cuh"

#define AGREE_WARPS (AGREE_THREADS / 32)

__device__ __forceinline__ u64 agree_s(u64 x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

__device__ __forceinline__ u64 agree_mix3(u64 a, u64 b, u64 c) { return agree_s(agree_s(agree_s(a) ^ b) ^ c); }

extern "C" __global__ void __launch_bounds__(AGREE_THREADS) canary_agree(const AgreeParams p) {
    __shared__ u64 s_warp[2][AGREE_WARPS];
    // load_int (canary_ints.cuh) sign-extends an int32 element, as the host formula's as_u64 does
    const i64 ws = p.entry_wide & AGREE_WIDE_SLOTS, wt = p.entry_wide & AGREE_WIDE_TOKENS,
              wp = p.entry_wide & AGREE_WIDE_POSITIONS;
    i64 nv = (i64)*p.plan_num_valid;
    nv = nv < 0 ? 0 : (nv > p.plan_capacity ? p.plan_capacity : nv);
    const i64 stride = (i64)gridDim.x * blockDim.x;
    u64 plan = 0, entries = 0;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nv; i += stride)
        plan += agree_mix3((u64)p.plan_slots[i] & 0x7FFFFFFFFFFFFFFFULL, (u64)p.plan_tokens[i],
                           (u64)p.plan_positions[i] ^ AGREE_PLAN_SALT);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += stride) {
        const i64 slot = load_int(p.slots, ws, i);
        if (slot >= 0)
            entries += agree_mix3((u64)slot, (u64)load_int(p.tokens, wt, i),
                                  (u64)load_int(p.positions, wp, i) ^ AGREE_ENTRY_SALT);
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        plan += __shfl_xor_sync(0xffffffffu, plan, d);
        entries += __shfl_xor_sync(0xffffffffu, entries, d);
    }
    if ((threadIdx.x & 31) == 0) {
        s_warp[0][threadIdx.x >> 5] = plan;
        s_warp[1][threadIdx.x >> 5] = entries;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 a = 0, b = 0;
        for (int w = 0; w < AGREE_WARPS; ++w) {
            a += s_warp[0][w];
            b += s_warp[1][w];
        }
        // Adding 0 changes nothing: a block with no share skips its atomics
        if (a) atomicAdd(reinterpret_cast<unsigned long long*>(p.out), (unsigned long long)a);
        if (b) atomicAdd(reinterpret_cast<unsigned long long*>(p.out + 1), (unsigned long long)b);
    }
}
