// Included by plan.cu, records.cu and records_move.cu after canary_constants.cuh (not a standalone header): the
// integer arrays that arrive as the engine has them, int32 or int64 each (SPEC 2 (*)).

// Element i of an int32 or int64 array, sign-extended to int64: what the same value passed as int64 reads. One
// launch reads an array at one width, so the branch is uniform across the grid (no divergence, no allocation,
// no instantiation a width: a CUDA graph captured for one width stays right only for that width, as for any
// pointer it holds).
__device__ __forceinline__ i64 load_int(const void* a, i64 wide, i64 i) {
    return wide ? static_cast<const i64*>(a)[i] : (i64) static_cast<const int*>(a)[i];
}
