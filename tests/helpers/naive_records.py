"""A naive, serial, pure-Python oracle of the canary write and verify (docs/canary.md), for the tests.

Written straight from the prose of docs/canary.md with Python ints and explicit 64-bit masking, sharing no
code with ``canary.hashes``, ``canary.realkv`` or the reference backend: one loop iteration per request,
entry and word, exactly as the GPU twins run them (one block per request, one thread per verify entry).
"""
from __future__ import annotations

from dataclasses import dataclass, field

M64 = 0xFFFF_FFFF_FFFF_FFFF
ANCHOR = 0xC0FFEE1234567890
SKIP_SEED = -(1 << 63)  # a request seeded so writes nothing (a padding row's tokens)
MISSING_SLOT = -(1 << 62)  # a verify slot: an in-window position whose SWA mapping was cleared


def s64(x: int) -> int:
    x &= M64
    return x - (1 << 64) if x >> 63 else x


def splitmix64(x: int) -> int:
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    x ^= x >> 31
    return x


def mix3(a: int, b: int, c: int) -> int:
    return s64(splitmix64(splitmix64(splitmix64(a) ^ (b & M64)) ^ (c & M64)))


# The affine chain over the prime field P = 2**61 - 1 (SPEC 4), straight from the prose with Python ints.
P = (1 << 61) - 1
TAG = 1 << 62
A = 0x1E5F3A9C7B2D4861
LINK_NONE = s64(TAG | (splitmix64(ANCHOR) % P))


def chain_link(prev_hash: int, tok: int, pos: int) -> int:
    """``TAG | (A h + g(tok, pos)) mod P`` when ``prev_hash & M64 == TAG + h`` with ``h < P``, else 0."""
    h = (prev_hash & M64) - TAG
    if not 0 <= h < P:
        return 0
    g = (mix3(ANCHOR, tok, pos) & M64) % P
    return s64(TAG | ((A * h + g) % P))


@dataclass
class Source:
    data: bytes  # the whole [rows, row_stride] byte image
    row_stride: int
    page_size: int
    num_bytes_per_token: int
    read_bytes: int


@dataclass
class NaiveState:
    fields: list[list[int]]  # [num_slots][token, position, prev_hash, real_kv_hash]
    ring: list[list[int]]  # [capacity][8]
    write_index: int  # uint32 count
    slot_runs: list[int] = field(default_factory=lambda: [0, 0])
    kernel_runs: list[int] = field(default_factory=lambda: [0, 0])
    check_flags: int = 3
    sources: list[Source] = field(default_factory=list)
    mode: int = 2  # 0 NONE, 1 PARTIAL, 2 ALL
    reported: list[int] | None = None  # SPEC 4's reported slots: bit 1 drops a slot's rows, bit 2 its MISSING rows
    padding_slot: int = 0  # the records' (SPEC 4): -1 verifies slot 0 and has MISSING_SLOT as "no link"

    def is_reported(self, slot: int, bit: int) -> bool:
        return self.reported is not None and 0 <= slot < len(self.fields) and bool(self.reported[slot] & bit)

    def append(self, row: list[int]) -> None:
        idx = self.write_index
        if idx < len(self.ring):
            self.ring[idx] = list(row)
        self.write_index = (idx + 1) & 0xFFFF_FFFF

    def real_kv_hash(self, slot: int) -> int:
        if self.mode == 0 or not self.sources:
            return 0
        acc = 0
        for src in self.sources:
            row, off = slot // src.page_size, (slot % src.page_size) * src.num_bytes_per_token
            base = row * src.row_stride + off
            n = 16 if self.mode == 1 else src.read_bytes
            h = 0
            for w in range(0, n, 8):
                h = splitmix64(h ^ int.from_bytes(src.data[base + w : base + w + 8], "little"))
            acc = splitmix64(acc ^ h)
        return s64(acc | 1)  # the lowest bit forced: no bytes fold to 0, an unwritten record's hash

    def link(self, slot: int) -> int:
        tok, pos, prev, _ = self.fields[slot]
        return chain_link(prev, tok, pos)


def clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(x, hi))


def write(st: NaiveState, *, offsets, seeds, num_valid_reqs, loc, ids, positions, exp_ids=None, exp_pos=None,
          tag: int = 1) -> None:
    st.kernel_runs[0] += 1
    num_slots, n = len(st.fields), len(loc)
    nreq = clamp(num_valid_reqs, 0, len(seeds))
    chain_on = bool(st.check_flags & 1)
    seed_link, seed_pos = [], []
    for r in range(nreq):  # every seed is read before anything is stored
        s = seeds[r]
        if 0 <= s < num_slots:
            seed_link.append(st.link(s))
            seed_pos.append(st.fields[s][1])
        else:
            seed_link.append(LINK_NONE)
            seed_pos.append(-1)
    for r in range(nreq):
        if seeds[r] == SKIP_SEED:  # a padding row's tokens (docs/records.md 4): nothing of them is looked at
            continue
        running, prev = seed_link[r], seed_pos[r]
        for i in range(clamp(offsets[r], 0, n), clamp(offsets[r + 1], 0, n)):
            slot = loc[i]
            if slot < 0:
                continue
            st.slot_runs[0] += 1
            tok, pos = ids[i], positions[i]
            bits = 0
            in_range = slot < num_slots
            if not in_range:
                bits |= 64
            et = exp_ids[i] if exp_ids is not None else -1
            if et != -1 and tok != et:
                bits |= 8
            ep = exp_pos[i] if exp_pos is not None else -1
            arr_fail = ep != -1 and pos != ep
            chain_exp = s64(prev + 1)
            chain_fail = chain_on and pos != chain_exp
            if arr_fail or chain_fail:
                bits |= 16
            if arr_fail:
                aux = ep
            elif chain_fail:
                aux = chain_exp
            elif ep != -1:
                aux = ep
            elif chain_on:
                aux = chain_exp
            else:
                aux = -1
            if bits:
                st.append([tag, slot, pos, tok, et, running, aux, bits])
            if in_range:
                st.fields[slot] = [tok, pos, running, st.real_kv_hash(slot)]
                running = chain_link(running, tok, pos)
                prev = pos


def verify(st: NaiveState, *, slots, exp_tokens, exp_positions, prev_slots, num_valid, enable, tag: int = 2) -> None:
    st.kernel_runs[1] += 1
    if enable == 0:
        return
    num_slots = len(st.fields)
    token_on = bool(st.check_flags & 2)
    real0 = st.padding_slot == -1
    lowest, no_link = (0, MISSING_SLOT) if real0 else (1, 0)
    for i in range(clamp(num_valid, 0, len(slots))):
        slot = slots[i]
        if slot == 0 and not real0:
            continue
        st.slot_runs[1] += 1
        ep, et, prev = exp_positions[i], exp_tokens[i], prev_slots[i]
        if slot == MISSING_SLOT:  # reported, never read
            if not st.is_reported(prev, 2):
                st.append([tag, slot, ep, 0, et, 0, prev, 128])  # expected_aux: the predecessor, naming the request
            continue
        if not lowest <= slot < num_slots:
            st.append([tag, slot, ep, 0, et, 0, 0, 64])
            continue
        tok, pos, prev_hash, kv = st.fields[slot]
        bits = 0
        if prev == -1:
            checked, expected = True, LINK_NONE
        elif lowest <= prev < num_slots:
            checked, expected = True, st.link(prev)
        else:
            checked, expected = False, 0
            if prev != no_link:
                bits |= 64
        if checked and prev_hash != expected:
            bits |= 1
        if pos != ep:
            bits |= 2
        if token_on and et != -1 and tok != et:
            bits |= 32
        if st.mode != 0 and st.sources and kv != st.real_kv_hash(slot):
            bits |= 4
        if bits and not st.is_reported(slot, 1):
            st.append([tag, slot, ep, tok, et, prev_hash, expected, bits])
