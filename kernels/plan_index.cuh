// Part of kernels/plan.cu, which includes it in order after canary_constants.cuh (not a standalone header):
// the index the attention reads, in the form FORM the kernels are specialized for (SPEC 3.8): a row's key and
// bound (row_key) and the raw slot at a virtual token index (load_raw). Every form is read at v = key * stride +
// position, with key = rp (req_to_token, block table) or kv_indptr[r] (page list) and stride = p.r2t_row_stride
// (the host's KVIndex.key_stride), so that the row table, the sampling and the entries keep one index arithmetic
// for all three; a paged form then reads block v / page_size at offset v % page_size.

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

// The per-step arrays, int32 or int64 each (PlanParams.step_wide, SPEC 2 (*)), element r widened.
__device__ __forceinline__ i64 step_rp(const PlanParams& p, i64 r) {
    return load_int(p.req_pool_indices, p.step_wide & STEP_WIDE_REQ_POOL_INDICES, r);
}
__device__ __forceinline__ i64 step_extend(const PlanParams& p, i64 r) {
    return load_int(p.extend_seq_lens, p.step_wide & STEP_WIDE_EXTEND_SEQ_LENS, r);
}
__device__ __forceinline__ i64 step_prefix(const PlanParams& p, i64 r) {
    return load_int(p.prefix_lens, p.step_wide & STEP_WIDE_PREFIX_LENS, r);
}
__device__ __forceinline__ i64 step_valid(const PlanParams& p, i64 r) {
    return load_int(p.valid_lens, p.step_wide & STEP_WIDE_VALID_LENS, r);
}
__device__ __forceinline__ i64 step_pool_row(const PlanParams& p, i64 r) {
    return load_int(p.expected_token_pool_indices, p.step_wide & STEP_WIDE_EXPECTED_TOKEN_POOL_INDICES, r);
}

// kv_indptr[r], int32 or int64 (one launch reads one width: a uniform branch).
__device__ __forceinline__ i64 load_indptr(const PlanParams& p, i64 r) {
    return p.kv_indptr_wide ? reinterpret_cast<const i64*>(p.kv_indptr)[r] : (i64)p.kv_indptr[r];
}

// A page list's row (SPEC 3.8) from its kv_indptr pair: its key (the first page, 0 when bad), the positions it holds
// (cap, in place of max_seq_len in its checks; max_seq_len for a bad pair) and whether the pair is out of order or
// past kv_indices (bad: BAD_REQ_POOL_INDEX, as a bad rp). Other forms: key rp, cap max_seq_len, never bad.
template <int FORM>
__device__ __forceinline__ i64 row_key(const PlanParams& p, i64 rp, i64 lo, i64 hi, i64& cap, bool& bad) {
    cap = p.max_seq_len;
    bad = false;
    if (FORM != CANARY_FORM_PAGES) return rp;
    if (rp == 0) return 0;  // padding rows read nothing of the index
    bad = lo < 0 || hi < lo || hi > p.kv_nnz;
    if (bad) return 0;
    cap = (hi - lo) * p.page_size;  // <= kv_nnz * page_size < 2^62 (checked at bind)
    return lo;
}

// The raw slot R at virtual index v (SPEC 3.8): req_to_token's value; for a block b of a paged form, 0 for b = 0
// (the padding block: what a 0 of req_to_token means), b * page_size + v % page_size for 0 < b <= INT32_MAX, and -1
// for b < 0 or (an int64 table's) b > INT32_MAX, which sets bad (BAD_SLOT, written as -1 like a slot past the LUT):
// the bound keeps b * page_size in the range an int32 table's entries have. inv_ps = 1.0 / page_size (paged forms).
// p.table_wide: the table holds int64 entries (SPEC 2 (*)), read as two int32 words.
// With CANARY_PADDING_NEG (padding_slot = -1) block 0 is real and b < 0 is the engine's padding marker: -1, not bad.
template <int FORM>
__device__ __forceinline__ i64 load_raw(const PlanParams& p, i64 v, double inv_ps, int& bad) {
    if (FORM == CANARY_FORM_TOKENS) return (i64)p.req_to_token[v];
    const i64 s = p.page_size;
    const i64 page = floor_div(v, s, inv_ps);  // v < 2^62 and v / s < 2^50 (checked at bind)
    const i64 b = load_int(p.req_to_token, p.table_wide, page);
    if (b > 0x7fffffffLL) { bad = 1; return -1; }
    if (CANARY_PADDING_NEG) return b < 0 ? -1 : b * s + (v - page * s);
    if (b < 0) { bad = 1; return -1; }
    return b == 0 ? 0 : b * s + (v - page * s);
}
