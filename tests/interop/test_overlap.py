"""The overlap primitives: ``check_disjoint`` (outputs apart from everything, inputs may share) and ``Spans``
(one bisection against ranges already known to be disjoint). Fake views: addresses only, never dereferenced."""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from canary.interop.adapter import ArrayView
from canary.interop.overlap import Spans, check_disjoint, span_bytes, spans


def fake(name: str, ptr: int, shape=(4,), strides=(1,), dtype=np.int64, device_id: int = 0) -> ArrayView:
    return ArrayView(name, ptr, tuple(shape), tuple(strides), np.dtype(dtype), device_id, False, None)


def message(name: str, other: str, at: int, start: int, end: int) -> str:
    return (f"kv-canary: {name}: expected memory separate from {other}, got an overlap at {at:#x} "
            f"({other} spans [{start:#x}, {end:#x}))")


def test_span_bytes():
    assert span_bytes(fake("a", 0, (4,))) == 32
    assert span_bytes(fake("a", 0, (3, 5), (8, 1), np.int32)) == (2 * 8 + 4 + 1) * 4  # gaps between rows count
    assert span_bytes(fake("a", 0, (0, 5), (8, 1))) == 0
    assert span_bytes(fake("a", 0, (), ())) == 8


def test_outputs_apart_and_adjacent_pass():
    check_disjoint(spans([fake("a", 0x1000), fake("b", 0x1020), fake("c", 0x2000)]))


def test_two_outputs_overlapping_by_one_byte():
    with pytest.raises(ValueError) as info:
        check_disjoint(spans([fake("a", 0x1000), fake("b", 0x101F, dtype=np.uint8)]))
    assert str(info.value) == message("b", "a", 0x101F, 0x1000, 0x1020)


def test_inputs_may_overlap_each_other_but_not_an_output():
    check_disjoint(spans([fake("out", 0x3000)]), spans([fake("x", 0x1000), fake("y", 0x1008), fake("z", 0x1000)]))
    with pytest.raises(ValueError) as info:
        check_disjoint(spans([fake("out", 0x1010)]), spans([fake("x", 0x1000), fake("y", 0x1008)]))
    assert str(info.value) == message("out", "y", 0x1010, 0x1008, 0x1028)


def test_an_input_after_a_long_output_is_seen_past_a_short_input():
    """The output reaching furthest is kept even when a shorter input comes between."""
    out = fake("out", 0x1000, (64,))
    with pytest.raises(ValueError) as info:
        check_disjoint(spans([out]), spans([fake("x", 0x1008), fake("y", 0x1100)]))
    assert str(info.value) == message("x", "out", 0x1008, 0x1000, 0x1200)


def test_other_devices_and_empty_arrays_never_overlap():
    check_disjoint(spans([fake("a", 0x1000, device_id=0), fake("b", 0x1000, device_id=1),
                          fake("c", 0x1000, (0,))]))


@pytest.mark.parametrize("ptr, nbytes, hit", [(0x0FF8, 8, None), (0x0FF8, 9, "a"), (0x1020, 16, None),
                                              (0x101F, 1, "a"), (0x1030, 0x1000, "b"), (0x3000, 8, None),
                                              (0x0000, 0x10000, "b")])
def test_spans_bisection(ptr, nbytes, hit):
    table = Spans(spans([fake("b", 0x2000), fake("a", 0x1000)]), 0)
    if hit is None:
        table.check_range("x", 0, ptr, nbytes)
        return
    with pytest.raises(ValueError, match=re.escape(f"kv-canary: x: expected memory separate from {hit}")):
        table.check_range("x", 0, ptr, nbytes)


def test_spans_agree_with_a_pairwise_search():
    rng = np.random.default_rng(0)
    for _ in range(200):
        starts = np.sort(rng.choice(np.arange(0, 4096, 8), 6, replace=False))
        ranges = [(int(s), int(min(s + rng.integers(1, 64), e))) for s, e in
                  itertools.zip_longest(starts, starts[1:], fillvalue=1 << 20)]
        table = Spans([(fake(f"r{i}", s, (e - s,), dtype=np.uint8), e - s) for i, (s, e) in enumerate(ranges)], 0)
        p, n = int(rng.integers(0, 4200)), int(rng.integers(1, 100))
        expect = any(p < e and s < p + n for s, e in ranges)
        try:
            table.check_range("x", 0, p, n)
            got = False
        except ValueError:
            got = True
        assert got == expect, (ranges, p, n)
