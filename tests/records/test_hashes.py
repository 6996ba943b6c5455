"""Frozen vectors for the canary hashes (SPEC 4).

The literals were computed once from the definitions with pure-Python integers (``naive_canary.splitmix64``,
with explicit 64-bit masking), independently of the NumPy code under test, and pasted here. The CUDA and
Numba twins must reproduce them bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.naive_records import M64
from helpers.naive_records import splitmix64 as _splitmix64_py  # the independent pure-Python definition

from canary.contract import hashes

from helpers.hash_vectors import CHAIN_ANCHOR_LINK, CHAIN_LINK_VECTORS, MIX3_VECTORS, MULMOD_VECTORS, SPLITMIX64_VECTORS
from helpers.naive_records import chain_link as _chain_link_py

LINK_OF_NONE = CHAIN_ANCHOR_LINK  # link(-1) = TAG | (splitmix64(0xC0FFEE1234567890) mod P)
P61 = (1 << 61) - 1


def _mix3_py(a: int, b: int, c: int) -> int:
    return _splitmix64_py(_splitmix64_py(_splitmix64_py(a) ^ (b & M64)) ^ (c & M64))


def _u(values) -> list[int]:
    return [int(v) for v in np.asarray(values).view(np.uint64).ravel()]


def test_constants():
    assert hashes.CHAIN_ANCHOR == 0xC0FFEE1234567890
    assert hashes.ANCHOR_LINK & M64 == LINK_OF_NONE
    assert -(1 << 63) <= hashes.ANCHOR_LINK < (1 << 63)  # stored as an int64 bit pattern


def test_splitmix64_vectors():
    xs = np.array([x for x, _ in SPLITMIX64_VECTORS], dtype=np.uint64)
    out = hashes.splitmix64(xs)
    assert out.dtype == np.int64 and out.shape == xs.shape
    assert _u(out) == [y for _, y in SPLITMIX64_VECTORS]
    # The same bits from int64 input (bit patterns), and from Python ints one at a time.
    assert _u(hashes.splitmix64(xs.view(np.int64))) == [y for _, y in SPLITMIX64_VECTORS]
    for x, y in SPLITMIX64_VECTORS:
        r = hashes.splitmix64(x)
        assert r.shape == () and r.dtype == np.int64 and int(r) & M64 == y
        assert _splitmix64_py(x) == y


def test_mix3_vectors():
    a, b, c, want = (np.array(col, dtype=np.uint64) for col in zip(*MIX3_VECTORS))
    out = hashes.mix3(a.view(np.int64), b.view(np.int64), c.view(np.int64))
    assert out.dtype == np.int64
    assert _u(out) == [int(w) for w in want]
    for va, vb, vc, w in MIX3_VECTORS:
        assert int(hashes.mix3(va, vb, vc)) & M64 == w == _mix3_py(va, vb, vc)


def test_link():
    assert int(hashes.link(-1, 0, 0, 0)) & M64 == LINK_OF_NONE
    # Stored fields of a slot are ignored for slot -1; any negative slot means "no predecessor".
    ph, tok, pos, want = (np.array(col, dtype=np.uint64) for col in zip(*CHAIN_LINK_VECTORS))
    slots = np.arange(len(CHAIN_LINK_VECTORS))
    got = hashes.link(slots, ph.view(np.int64), tok.view(np.int64), pos.view(np.int64))
    assert got.dtype == np.int64 and _u(got) == [int(w) for w in want]
    got = hashes.link(np.array([-1, -7]), np.array([123, 0]), np.array([9, 9]), np.array([4, 4]))
    assert _u(got) == [LINK_OF_NONE, LINK_OF_NONE]
    for p_, t, q, w in CHAIN_LINK_VECTORS:
        assert int(hashes.link(1, p_, t, q)) & M64 == w == _chain_link_py(p_, t, q) & M64


def test_chain_constants():
    assert hashes.FIELD_P == P61 and hashes.CHAIN_TAG == 1 << 62 and hashes.NOT_A_LINK == 0
    assert 1 < hashes.CHAIN_MUL < P61 and hashes.CHAIN_MUL % 2 == 1
    assert hashes.ANCHOR_LINK == CHAIN_ANCHOR_LINK  # a chain value: positive as int64
    assert hashes.G_KEY == int(hashes.splitmix64(hashes.CHAIN_ANCHOR)) & M64


def test_mulmod_vectors():
    a, b, want = (np.array(col, dtype=np.uint64) for col in zip(*MULMOD_VECTORS))
    assert [int(v) for v in hashes.mulmod_p(a, b)] == [int(w) for w in want] == [
        int(x) * int(y) % P61 for x, y in zip(a, b)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, P61 - 1), st.integers(0, P61 - 1)), min_size=1, max_size=16),
       st.integers(0, M64))
def test_field_arithmetic_matches_python_ints(pairs, x):
    a, b = (np.array(col, dtype=np.uint64) for col in zip(*pairs))
    assert [int(v) for v in hashes.mulmod_p(a, b)] == [p * q % P61 for p, q in pairs]
    assert int(hashes.reduce_p(np.array([x], dtype=np.uint64))[0]) == x % P61


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.integers(0, 2**32 - 1))
def test_chain_values_scan_equals_repeated_link(counts, seed):
    """The vectorized scan is the serial chain: h_{k+1} = link(record k), request by request."""
    rng = np.random.default_rng(seed)
    counts = np.array(counts)
    heads = rng.integers(-(1 << 63), 1 << 63, size=counts.size, dtype=np.int64)
    valid = rng.random(counts.size) < 0.8
    heads = np.where(valid, (1 << 62) | (heads & P61), heads)  # mostly chain values, some damage
    tok = rng.integers(-(1 << 63), 1 << 63, size=int(counts.sum()), dtype=np.int64)
    pos = rng.integers(-3, 1 << 40, size=tok.size)
    got = [int(v) for v in hashes.chain_values(heads, counts, tok, pos)]
    want, j = [], 0
    for r, c in enumerate(counts):
        h = int(heads[r]) & M64
        h = h if _chain_link_py(h, 0, 0) else 0  # a head that is no chain value stays NOT_A_LINK
        want.append(h)
        for _ in range(int(c)):
            h = _chain_link_py(h, int(tok[j]), int(pos[j])) & M64
            want.append(h)
            j += 1
    assert got == want


def test_signed_inputs_sign_extend():
    # An int32 token -1 hashes like the int64 token -1 (both are 0xFFFF_FFFF_FFFF_FFFF).
    assert int(hashes.mix3(np.int64(0), np.int32(-1), np.int64(0))) == int(hashes.mix3(0, -1, 0))
    assert int(hashes.mix3(0, -1, 0)) & M64 == _mix3_py(0, M64, 0)


def test_no_overflow_warnings():
    with np.errstate(all="raise"):
        hashes.splitmix64(np.uint64(M64))
        hashes.splitmix64(np.full(7, -1, dtype=np.int64))
        hashes.mix3(np.int64(-1), np.int64(-1), np.int64(-1))


def test_input_not_modified():
    x = np.array([1, 2, 3], dtype=np.uint64)
    hashes.splitmix64(x)
    hashes.mix3(x, x, x)
    assert x.tolist() == [1, 2, 3]


def test_rejects_floats():
    with pytest.raises(TypeError, match="kv-canary"):
        hashes.splitmix64(np.array([1.0]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, M64), min_size=1, max_size=16), st.integers(0, M64), st.integers(-(1 << 63), (1 << 63) - 1))
def test_matches_pure_python(xs, b, c):
    got = _u(hashes.splitmix64(np.array(xs, dtype=np.uint64)))
    assert got == [_splitmix64_py(x) for x in xs]
    got3 = _u(hashes.mix3(np.array(xs, dtype=np.uint64), b, c))
    assert got3 == [_mix3_py(x, b, c) for x in xs]
