"""Real-KV sources: zero-copy byte views, host validation, and the reference fold (SPEC 4)."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import naive_records as naive
from helpers.hash_vectors import FOLD_SLOT, REAL_KV_FOLD_VECTORS, fold_vector_sources
from helpers.naive_records import splitmix64 as _sm  # the oracle's pure-Python definition

from canary.contract.realkv import MAX_SOURCES, RealKVMode, fold, real_kv, real_kv_source

def _fold_py(token_bytes_per_source: list[bytes]) -> int:
    """SPEC 4 by hand: per source, acc = s(acc ^ word) over little-endian words; combine acc = s(acc ^ h); then
    the lowest bit forced to 1."""
    acc = 0
    for b in token_bytes_per_source:
        h = 0
        for w in range(0, len(b), 8):
            h = _sm(h ^ int.from_bytes(b[w : w + 8], "little"))
        acc = _sm(acc ^ h)
    return acc | 1


def _u(x) -> list[int]:
    return [int(v) for v in np.asarray(x).view(np.uint64).ravel()]


@pytest.fixture
def paged():
    """A paged uint8 source: 4 rows of 3 tokens x 32 bytes, plus 16 spare bytes per row."""
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, size=(4, 3 * 32 + 16), dtype=np.uint8)


def test_fold_matches_hand_computation(paged):
    kv = real_kv([(paged, 3, 32, 32)], "all")
    slots = np.arange(12)
    want = [_fold_py([paged[s // 3, (s % 3) * 32 : (s % 3) * 32 + 32].tobytes()]) for s in slots]
    assert _u(fold(kv, slots)) == want
    partial = real_kv([(paged, 3, 32, 32)], RealKVMode.PARTIAL)
    want16 = [_fold_py([paged[s // 3, (s % 3) * 32 : (s % 3) * 32 + 16].tobytes()]) for s in slots]
    assert _u(fold(partial, slots)) == want16


def test_two_sources_combine_in_order(paged):
    rng = np.random.default_rng(2)
    tok_major = rng.integers(0, 256, size=(12, 48), dtype=np.uint8)
    kv = real_kv([(paged, 3, 32, 16), (tok_major, 1, 48, 32)])
    slots = np.array([0, 5, 11, 5])
    want = [_fold_py([paged[s // 3, (s % 3) * 32 : (s % 3) * 32 + 16].tobytes(), tok_major[s, :32].tobytes()])
            for s in slots]
    assert _u(fold(kv, slots)) == want
    swapped = real_kv([(tok_major, 1, 48, 32), (paged, 3, 32, 16)])
    assert (fold(swapped, slots) != fold(kv, slots)).all()


def test_one_flipped_byte_changes_only_its_slot(paged):
    kv = real_kv([(paged, 3, 32, 32)])
    before = fold(kv, np.arange(12))
    paged[2, 1 * 32 + 7] ^= 0x10  # slot 7, byte 7
    after = fold(kv, np.arange(12))  # zero-copy: the source sees the caller's write
    assert list(np.flatnonzero(before != after)) == [7]


def test_partial_ignores_bytes_past_16(paged):
    kv_all = real_kv([(paged, 3, 32, 32)], "ALL")
    kv_part = real_kv([(paged, 3, 32, 32)], "PARTIAL")
    a0, p0 = fold(kv_all, [4]), fold(kv_part, [4])
    paged[1, 32 + 16] ^= 1  # slot 4, byte 16
    assert fold(kv_part, [4]) == p0 and fold(kv_all, [4]) != a0
    paged[1, 32 + 15] ^= 1  # slot 4, byte 15
    assert fold(kv_part, [4]) != p0


def test_all_reads_read_bytes_only(paged):
    kv = real_kv([(paged, 3, 32, 16)], "all")
    h = fold(kv, [0])
    paged[0, 16:32] ^= 0xFF
    paged[0, 3 * 32 :] ^= 0xFF  # the spare bytes past the page's tokens are never read either
    assert fold(kv, [0]) == h


@pytest.mark.parametrize("sources, want", REAL_KV_FOLD_VECTORS, ids=range(len(REAL_KV_FOLD_VECTORS)))
def test_fold_frozen_vectors(sources, want):
    """The frozen vectors (helpers/hash_vectors.py): the oracle and the reference fold reproduce them, in mode ALL
    (read_bytes = the vector's words) and, for sources of two words, in mode PARTIAL with more bytes per token."""
    arrays = fold_vector_sources(sources)
    srcs = [naive.Source(a.tobytes(), a.size // 2 * 8, 1, a.size // 2 * 8, a.size // 2 * 8) for a in arrays]
    oracle = naive.NaiveState(fields=[], ring=[], write_index=0, sources=srcs, mode=int(RealKVMode.ALL))
    assert oracle.real_kv_hash(FOLD_SLOT) & naive.M64 == want
    if sources:  # _fold_py is the fold of mode PARTIAL / ALL; without sources the mode is NONE
        assert _fold_py([a[a.size // 2 :].tobytes() for a in arrays]) == want
    as_rows = [(a.view(np.uint8).reshape(2, -1), 1, a.size // 2 * 8) for a in arrays]
    assert _u(fold(real_kv(as_rows, "all"), [FOLD_SLOT])) == [want]
    if sources and all(len(w) == 2 for w in sources):
        # 48 bytes per token, the last 32 poison: PARTIAL reads the first 16 only.
        wide = [np.concatenate([a.reshape(2, 2), np.full((2, 4), 0xA5A5A5A5A5A5A5A5, np.uint64)], axis=1)
                for a in arrays]
        partial = real_kv([(w.view(np.uint8), 1, 48) for w in wide], "partial")
        assert _u(fold(partial, [FOLD_SLOT])) == [want]


@pytest.mark.parametrize("mode", [RealKVMode.PARTIAL, RealKVMode.ALL])
@pytest.mark.parametrize("kinds", ["p", "t", "pt", "ptwp"])
def test_all_zero_bytes_fold_to_one(mode, kinds):
    """All-zero KV bytes fold to 1 in modes PARTIAL and ALL, for one and several sources (paged, token-major and
    wide-row layouts): never 0, the real_kv_hash of a never-written record. Mode NONE keeps 0."""
    layouts = {"p": (np.zeros((4, 3 * 32 + 16), np.uint8), 3, 32, 32),  # paged, 12 slots
               "t": (np.zeros((12, 32), np.float16), 1, 64, 48),  # token-major, reads 48 of 64 bytes
               "w": (np.zeros((6, 48), np.uint8)[:, :32], 2, 16, 16)}  # row stride 48 > row bytes 32
    kv = real_kv([layouts[k] for k in kinds], mode)
    assert _u(fold(kv, np.arange(12))) == [1] * 12
    assert _u(fold(real_kv([layouts[k] for k in kinds], "none"), np.arange(12))) == [0] * 12


def test_fold_is_odd_for_any_bytes():
    """The lowest bit is forced: random bytes, every mode with sources, every hash odd (hence never 0)."""
    rng = np.random.default_rng(8)
    a = rng.integers(0, 256, size=(64, 48), dtype=np.uint8)
    a[::3] = 0  # and some all-zero slots among them
    b = rng.integers(0, 256, size=(32, 2, 32), dtype=np.uint8)
    for mode in ("partial", "all"):
        h = np.asarray(fold(real_kv([(a, 1, 48), (b, 2, 32)], mode), np.arange(64))).view(np.uint64)
        assert (h & np.uint64(1) == 1).all()


def test_none_mode_and_no_sources(paged):
    assert (fold(real_kv([(paged, 3, 32)], "none"), np.arange(12)) == 0).all()
    kv = real_kv([])
    assert kv.mode == RealKVMode.NONE and not kv.active
    assert (fold(kv, [1, 2]) == 0).all()


def test_any_dtype_viewed_as_bytes_zero_copy():
    rng = np.random.default_rng(3)
    f16 = rng.standard_normal((5, 4, 2, 8)).astype(np.float16)  # [pages, page_size, heads, dim]: 32 B/token
    as_bytes = f16.view(np.uint8).reshape(5, 4 * 32).copy()
    kv_f16 = real_kv([(f16, 4, 32)])
    kv_u8 = real_kv([(as_bytes, 4, 32)])
    src = kv_f16.sources[0]
    assert (src.rows, src.row_bytes, src.row_stride_bytes) == (5, 128, 128)
    assert src.bytes.dtype == np.uint8 and np.shares_memory(src.bytes, f16)
    assert (fold(kv_f16, np.arange(20)) == fold(kv_u8, np.arange(20))).all()


def test_torch_bfloat16_zero_copy():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(6, 16, dtype=torch.bfloat16, generator=gen)  # token-major: 32 B/token
    kv = real_kv([(t, 1, 32)])
    ref = real_kv([(t.view(torch.uint8).numpy().copy(), 1, 32)])
    assert (fold(kv, np.arange(6)) == fold(ref, np.arange(6))).all()
    h = fold(kv, [3])
    t[3, 0] += 1
    assert fold(kv, [3]) != h


def test_row_stride_larger_than_row(paged):
    big = np.zeros((4, 256), dtype=np.uint8)
    big[:, : paged.shape[1]] = paged
    view = big[:, :96]  # row stride 256 bytes, row 96 bytes
    kv = real_kv([(view, 3, 32)])
    assert kv.sources[0].row_stride_bytes == 256
    assert (fold(kv, np.arange(12)) == fold(real_kv([(paged, 3, 32)]), np.arange(12))).all()


def test_dict_and_source_items(paged):
    a = real_kv([{"array": paged, "page_size": 3, "num_bytes_per_token": 32}])
    b = real_kv([real_kv_source(paged, page_size=3, num_bytes_per_token=32)])
    assert (fold(a, np.arange(12)) == fold(b, np.arange(12))).all()


def test_check_covers(paged):
    kv = real_kv([(paged, 3, 32)])
    kv.check_covers(12)
    with pytest.raises(ValueError, match=r"kv-canary: real_kv_sources\[0\]: expected rows \* page_size >= the 13 "
                                         r"slots of canary_buffer, got 4 \* 3 = 12"):
        kv.check_covers(13)


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"page_size": 3, "num_bytes_per_token": 24}, ValueError,
         r"real_kv_sources\[0\]\.num_bytes_per_token: expected a positive multiple of 16, got 24"),
        ({"page_size": 3, "num_bytes_per_token": 0}, ValueError, r"num_bytes_per_token: expected a positive multiple"),
        ({"page_size": 3, "num_bytes_per_token": -16}, ValueError, r"got -16"),
        ({"page_size": 3, "num_bytes_per_token": 32, "read_bytes": 8}, ValueError,
         r"read_bytes: expected a positive multiple of 16, got 8"),
        ({"page_size": 3, "num_bytes_per_token": 32, "read_bytes": 48}, ValueError,
         r"read_bytes: expected <= num_bytes_per_token = 32, got 48"),
        ({"page_size": 0, "num_bytes_per_token": 32}, ValueError, r"page_size: expected a positive int, got 0"),
        ({"page_size": True, "num_bytes_per_token": 32}, TypeError, r"page_size: expected an int, got bool"),
        ({"page_size": 4, "num_bytes_per_token": 32}, ValueError,
         r"real_kv_sources\[0\]: expected page_size \* num_bytes_per_token <= row_bytes, got 4 \* 32 = 128 > 112"),
    ],
)
def test_source_validation(paged, kwargs, exc, message):
    with pytest.raises(exc, match="kv-canary: .*" + message):
        real_kv_source(paged, **kwargs)


def test_layout_validation(paged):
    with pytest.raises(ValueError, match=r"kv-canary: .*array: expected at least 2 axes \[rows, \.\.\.\], got shape"):
        real_kv_source(np.zeros(64, np.uint8), page_size=1, num_bytes_per_token=16)
    with pytest.raises(ValueError, match=r"expected contiguous axes after the first"):
        real_kv_source(np.zeros((4, 32, 8), np.uint8).transpose(0, 2, 1), page_size=1, num_bytes_per_token=16)
    base = np.zeros((4, 64 + 16), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"expected 16-byte aligned rows, got base address .* and row stride 80"):
        real_kv_source(base[:, 8:40], page_size=1, num_bytes_per_token=16)
    odd = np.zeros((4, 40), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"row stride 40 bytes"):
        real_kv_source(odd[:, :32], page_size=1, num_bytes_per_token=32)
    with pytest.raises(ValueError, match=r"real_kv_sources: expected at most 4 sources, got 5"):
        real_kv([(paged, 3, 32)] * (MAX_SOURCES + 1))
    with pytest.raises(TypeError, match=r"real_kv_sources\[1\]: expected a RealKVSource, a dict or a tuple"):
        real_kv([(paged, 3, 32), paged])
    with pytest.raises(ValueError, match=r"real_kv_mode: expected one of NONE, PARTIAL, ALL, got 'some'"):
        real_kv([(paged, 3, 32)], "some")


def test_fold_rejects_out_of_range_slots(paged):
    kv = real_kv([(paged, 3, 32)])
    with pytest.raises(ValueError, match=r"slots: expected values in \[0, 12\)"):
        fold(kv, [12])


@pytest.mark.parametrize("field, value", [("rows", 4096), ("row_stride_bytes", 1 << 20), ("row_bytes", 4096),
                                          ("ptr", 8)])
def test_a_real_kv_source_that_does_not_describe_its_array_is_refused(field, value):
    """A RealKVSource's fields bound the kernels' reads: one edited to describe more than its array (rows past the
    array's) read past it on the host. real_kv rebuilds it from its array and refuses a mismatch."""
    import dataclasses

    from canary import CanaryRecords, CanaryState, real_kv, real_kv_source

    src = real_kv_source(np.zeros((4, 64), np.uint8), page_size=1, num_bytes_per_token=64)
    with pytest.raises(ValueError, match=rf"^kv-canary: real_kv_sources\[0\]: expected a RealKVSource that describes "
                                         rf"its array .*{field}={value}"):
        CanaryRecords(CanaryState.allocate(num_slots=4096), real_kv([dataclasses.replace(src, **{field: value})]))
    CanaryRecords(CanaryState.allocate(num_slots=4), real_kv([src]))  # the genuine one binds
