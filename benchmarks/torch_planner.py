"""A torch-vectorized planner: the peer every GPU engine can write in an afternoon (repeat_interleave + gathers).

It trusts its inputs (no device-side checks), needs a host sync to size its intermediates (``total``), so it
cannot be captured in a CUDA graph, and allocates per call. It exists to be measured beside the kernels;
on valid inputs its outputs are byte-identical to the reference (checked before it is timed).
"""
from __future__ import annotations

import torch


def torch_plan(*, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, swa_window_size=0,
               full_to_swa_index_mapping=None, req_to_verify_expected_tokens=None,
               req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0, out):
    """Plan into the torch tensors of ``out`` (keys: the field names of VerifyPlan and WritePlan)."""
    rpi, P, E = req_pool_indices, prefix_lens, extend_seq_lens
    lut, pool, vl = full_to_swa_index_mapping, req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens
    bs = rpi.shape[0]
    cap = out["verify_slot_indices"].shape[0]
    r_cap = out["write_seed_slot_indices"].shape[0]
    active = rpi != 0
    zero = torch.zeros_like(P)
    start = torch.clamp(P - swa_window_size, min=0) if swa_window_size > 0 else zero
    count = torch.where(active, P - start, zero)
    total = int(count.sum())  # the host sync

    def T(raw):
        if lut is None:
            return raw
        return torch.where(raw >= 0, lut[torch.clamp(raw, min=0)], raw)

    if total <= cap:
        row = torch.repeat_interleave(torch.arange(bs, device=P.device), count, output_size=total)
        first = torch.cumsum(count, 0) - count
        pos = start[row] + torch.arange(total, device=P.device) - first[row]
        rp = rpi[row]
        out["verify_slot_indices"][:total] = T(req_to_token[rp, pos].long())
        prev = req_to_token[rp, torch.clamp(pos - 1, min=0)].long()
        out["verify_prev_slot_indices"][:total] = torch.where(pos > 0, T(prev), torch.full_like(prev, -1))
        out["verify_expected_positions"][:total] = pos
        if pool is None:
            out["verify_expected_tokens"][:total] = -1
        else:
            col = pos + kv_token_id_vs_position_offset
            ok = (col >= 0) & (col < vl[row])
            tok = pool[rp, torch.where(ok, col, torch.zeros_like(col))].long()
            out["verify_expected_tokens"][:total] = torch.where(ok, tok, torch.full_like(tok, -1))
    wlen = torch.where(active & (E > 0), E, zero)
    offsets = out["write_offsets"]
    offsets[: r_cap + 1] = 0
    offsets[1 : bs + 1] = torch.cumsum(wlen, 0)
    seeded = active & (E > 0) & (P > 0)
    raw_seed = req_to_token[rpi, torch.clamp(P - 1, 0, req_to_token.shape[1] - 1)].long()  # padding P is garbage
    out["write_seed_slot_indices"][:bs] = torch.where(seeded, T(raw_seed), torch.full_like(raw_seed, -1))
    out["write_num_valid_reqs"][0] = bs
    overflow = total > cap
    out["verify_num_valid"][0] = min(total, cap)
    out["enable"][0] = 0 if overflow else 1
    out["status"][0] = 1 if overflow else 0
