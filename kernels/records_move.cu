// kv-canary: records that move (SPEC 4.1, docs/records.md 11), compiled by NVRTC through CuPy.
// Numba twin: records_move_numba.py. NumPy reference: canary/backends/reference/move.py.
//
// A slot's row is its record's four int64 fields (bytes 0 to 32 of the slot: bytes past them are the engine's),
// then its layer_hashes row when a layer table moves too: RECORD_WORDS + num_layers words. canary_gather_rows
// copies the rows of a slot list into a buffer, canary_scatter_rows copies buffer rows into a slot list; a copy
// inside the pool is a gather into the mover's scratch followed by a scatter from it, two launches on one stream,
// so every source is read before any destination is written. Nothing is re-keyed: the chain and the real-KV fold
// depend on a record's content and its KV bytes, never on its slot number.
//
// One thread per (entry, word) pair, grid-stride: consecutive threads touch consecutive words of a row. A slot
// outside [0, num_slots) is never dereferenced: a negative one is padding (gather: a zero row; scatter: skipped),
// one >= num_slots is refused into the sticky status word by the entry's word-0 thread (gather still writes its
// zero row). The grid depends only on the list's length (a host shape): graph-capturable, nothing allocated.

#include "canary_constants.cuh"
#include "canary_ints.cuh"

// The address of word w of slot s's row (0 <= s < num_slots, 0 <= w < RECORD_WORDS + num_layers).
__device__ __forceinline__ i64* row_word(const MoveParams& p, i64 s, i64 w) {
    if (w < RECORD_WORDS) return reinterpret_cast<i64*>(p.records + s * p.slot_stride) + w;
    return p.layer_hashes + s * p.num_layers + (w - RECORD_WORDS);
}

__device__ __forceinline__ void refuse(const MoveParams& p, unsigned long long fault) {
    atomicOr(&p.status[MOVE_STATUS_FAULTS], fault);
    atomicAdd(&p.status[MOVE_STATUS_REFUSED], 1ULL);
}

extern "C" __global__ void __launch_bounds__(MOVE_THREADS) canary_gather_rows(const MoveParams p) {
    const i64 words = RECORD_WORDS + p.num_layers;
    const i64 total = p.num_entries * words;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < total; j += (i64)gridDim.x * blockDim.x) {
        const i64 i = j / words, w = j - i * words;
        const i64 s = load_int(p.slots, p.slots_wide, i);
        const bool inside = s >= 0 && s < p.num_slots;
        if (w == 0 && s >= p.num_slots) refuse(p, MOVE_SOURCE_RANGE);
        p.rows[i * p.row_stride + w] = inside ? *row_word(p, s, w) : 0;  // a zero row: a never-written record
    }
}

extern "C" __global__ void __launch_bounds__(MOVE_THREADS) canary_scatter_rows(const MoveParams p) {
    const i64 words = RECORD_WORDS + p.num_layers;
    const i64 total = p.num_entries * words;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < total; j += (i64)gridDim.x * blockDim.x) {
        const i64 i = j / words, w = j - i * words;
        const i64 s = load_int(p.slots, p.slots_wide, i);
        if (s < 0) continue;  // padding
        if (s >= p.num_slots) {
            if (w == 0) refuse(p, MOVE_DEST_RANGE);
            continue;
        }
        *row_word(p, s, w) = p.rows[i * p.row_stride + w];
    }
}
