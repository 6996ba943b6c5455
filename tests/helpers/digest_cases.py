"""Cases for the block digest (SPEC 4.2): the reference against its twins, byte for byte, and a naive oracle.

A :class:`DigestCase` is a model's KV tensors (per layer a K and maybe a V tensor, in one of several memory
layouts: paged NHD, paged HND, padded heads, token-major) and a sequence of calls: ``compute`` and ``check`` (block
arrays, each int32 or int64), ``flip`` (one byte of one tensor changed on the host between calls). Every output is
poisoned before each call. :func:`run_case` runs it on a backend and returns every call's outputs; :func:`oracle`
is SPEC 4.2 written lane by lane in plain Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from canary import BlockDigest
from canary.contract.digest import BAD_DIGEST, DIGEST_ANCHOR, DIGEST_LANE_MUL, DigestStatus
from canary.interop.hostcopy import to_host

MASK = (1 << 64) - 1
LAYOUTS = ("nhd", "hnd", "padded", "token")


def s(x: int) -> int:
    """SPEC 4's splitmix64 on a Python int."""
    x &= MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def mix3(a: int, b: int, c: int) -> int:
    return s(s(s(a) ^ (b & MASK)) ^ (c & MASK))


@dataclass
class DigestCase:
    name: str
    seed: int
    num_layers: int
    num_kinds: int
    num_pages: int
    page_size: int
    heads: tuple  # per kind
    head_bytes: tuple  # per kind
    layout: str = "nhd"
    stacked: bool = True
    layer_offset: int = 0
    head_offset: int = 0
    max_blocks: int = 16
    calls: list = field(default_factory=list)

    def __repr__(self) -> str:
        return self.name


def base_arrays(case: DigestCase) -> list:
    """Per kind: the random bytes ``[L, ...]`` in the layout's allocation shape (host)."""
    rng = np.random.default_rng(case.seed)
    out = []
    for k in range(case.num_kinds):
        h, hb, p, ps = case.heads[k], case.head_bytes[k], case.num_pages, case.page_size
        shape = {"nhd": (p, ps, h, hb), "hnd": (p, h, ps, hb), "padded": (p, ps, h + 1, hb + 16),
                 "token": (p, h, hb)}[case.layout]
        out.append(rng.integers(0, 256, (case.num_layers,) + shape, dtype=np.uint8))
    return out


def tensor_view(case: DigestCase, a):
    """The ``[pages, page_size, heads, head_bytes]`` (or token-major) view of one layer's allocation."""
    if case.layout == "hnd":
        return a.transpose(0, 2, 1, 3)
    if case.layout == "padded":
        return a[:, :, 1:, 16:]  # heads and bytes past a gap: strides that are not the shape's
    return a


def layer_tensors(case: DigestCase, placed: list) -> list:
    """Stacked: views into one array per kind; else each layer's own array."""
    return [[tensor_view(case, placed[k][lay]) for k in range(case.num_kinds)] for lay in range(case.num_layers)]


def place_all(case: DigestCase, arrays: list, place) -> list:
    if case.stacked:
        return [place(a) for a in arrays]
    return [[place(np.ascontiguousarray(a[lay])) for lay in range(case.num_layers)] for a in arrays]


def host_words(case: DigestCase, arrays: list, lay: int, k: int) -> np.ndarray:
    """``[pages, page_size, heads, lanes]`` u64 of one tensor (from the host copy)."""
    v = tensor_view(case, arrays[k][lay])
    if case.layout == "token":
        v = v[:, None]
    return np.ascontiguousarray(v).view("<u8")


def oracle(case: DigestCase, arrays: list, indptr, indices, positions, lens) -> tuple[list, list]:
    """SPEC 4.2 lane by lane: ``(digests, status)`` as Python ints (digests as int64 values)."""
    nb = len(positions)
    nnz = len(indices)
    ps = case.page_size
    words = [[host_words(case, arrays, lay, k) for k in range(case.num_kinds)] for lay in range(case.num_layers)]
    digests, status = [], []
    for b in range(nb):
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        st = 0
        if lo < 0 or hi < lo or hi > nnz:
            st = int(DigestStatus.BAD_RANGE)
        else:
            n = (hi - lo) * ps if lens is None else int(lens[b])
            if n < 0 or n > (hi - lo) * ps:
                st = int(DigestStatus.BAD_RANGE)
        total = 0
        if st == 0:
            for j in range(n):
                page, o = int(indices[lo + j // ps]), j % ps
                if not 0 <= page < case.num_pages:
                    st |= int(DigestStatus.BAD_PAGE)
                    continue
                p = (int(positions[b]) + j) & MASK
                for lay in range(case.num_layers):
                    for k in range(case.num_kinds):
                        for h in range(case.heads[k]):
                            hk = mix3(DIGEST_ANCHOR, 2 * (case.layer_offset + lay) + k, case.head_offset + h)
                            for i in range(case.head_bytes[k] // 8):
                                key = (hk + ((p << 12) + i) * DIGEST_LANE_MUL) & MASK
                                total = (total + s(int(words[lay][k][page, o, h, i]) ^ key)) & MASK
        d = BAD_DIGEST & MASK if st else total
        digests.append(d - (1 << 64) if d >= 1 << 63 else d)
        status.append(st)
    return digests, status


def _widths(rng) -> dict:
    return {name: np.int64 if rng.random() < 0.5 else np.int32
            for name in ("kv_indptr", "kv_indices", "block_positions", "block_lens", "count")}


def random_blocks(rng, case: DigestCase, bad: bool = True) -> tuple:
    """``(indptr, indices, positions, lens or None)``: up to ``max_blocks`` blocks of 0 to 3 pages each, with
    (if ``bad``) a bad pair, a bad page or a bad length now and then."""
    nb = int(rng.integers(0, case.max_blocks + 1))
    counts = rng.integers(0, 4, nb)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    nnz = int(indptr[-1]) + int(rng.integers(0, 3))
    indices = rng.integers(0, case.num_pages, nnz).astype(np.int64)
    positions = rng.integers(-2, 1 << 20, nb).astype(np.int64)
    if rng.random() < 0.1:
        positions[:] = rng.integers(-(1 << 62), 1 << 62, nb)
    lens = None
    if rng.random() < 0.5:
        lens = np.minimum(rng.integers(0, 4 * case.page_size, nb), counts * case.page_size).astype(np.int64)
    if bad and nb and rng.random() < 0.3:
        b = int(rng.integers(0, nb))
        indptr[b + int(rng.integers(0, 2))] = int(rng.choice([-1, nnz + 1, -(1 << 40)]))
    if bad and nnz and rng.random() < 0.3:
        indices[int(rng.integers(0, nnz))] = int(rng.choice([-1, case.num_pages, 1 << 33]))
    if bad and lens is not None and nb and rng.random() < 0.3:
        lens[int(rng.integers(0, nb))] = int(rng.choice([-1, 4 * case.page_size + 1]))
    return indptr, indices, positions, lens


def random_case(seed: int) -> DigestCase:
    rng = np.random.default_rng(seed)
    layout = str(rng.choice(LAYOUTS))
    ps = 1 if layout == "token" else int(rng.choice([1, 2, 3, 4]))
    kinds = int(rng.integers(1, 3))
    case = DigestCase(f"random_{seed}_{layout}", seed, int(rng.integers(1, 4)), kinds, int(rng.integers(1, 7)), ps,
                      tuple(int(rng.integers(1, 4)) for _ in range(kinds)),
                      tuple(16 * int(rng.integers(1, 4)) for _ in range(kinds)), layout, bool(rng.random() < 0.5),
                      int(rng.integers(0, 3)), int(rng.integers(0, 5)), 8)
    for _ in range(int(rng.integers(1, 5))):
        r = rng.random()
        if r < 0.2:
            k = int(rng.integers(0, kinds))
            case.calls.append(("flip", int(rng.integers(0, case.num_layers)), k, int(rng.integers(0, 1 << 30))))
            continue
        blocks = random_blocks(rng, case)
        widths = _widths(rng)
        out_dtype = np.int64 if rng.random() < 0.5 else np.uint64
        if r < 0.6:
            case.calls.append(("compute", blocks, widths, out_dtype, bool(rng.random() < 0.7)))
        else:  # expected: the reference's digests, some changed, some BAD_DIGEST
            case.calls.append(("check", blocks, widths, out_dtype, int(rng.integers(0, 1 << 16))))
    return case


def hand_cases() -> list[DigestCase]:
    """One per layout and kind count, one page per block and multi-page blocks, a partial last page, bad input."""
    out = []
    for layout in LAYOUTS:
        for kinds in (1, 2):
            ps = 1 if layout == "token" else 4
            c = DigestCase(f"{layout}_{kinds}kinds", 7, 2, kinds, 6, ps, (2, 3)[:kinds], (32, 16)[:kinds], layout)
            w = dict.fromkeys(("kv_indptr", "kv_indices", "block_positions", "block_lens", "count"), np.int64)
            one = (np.arange(6, dtype=np.int64), np.array([3, 1, 4, 0, 5], dtype=np.int64),
                   np.arange(0, 5 * ps, ps, dtype=np.int64), None)
            multi = (np.array([0, 2, 2, 5, 7], dtype=np.int64), np.array([5, 0, 1, 2, 3, 4, -1], dtype=np.int64),
                     np.array([0, 100, 8, 1 << 40], dtype=np.int64), np.array([2 * ps - 1, 0, 3 * ps, 2], np.int64))
            badr = (np.array([0, 2, 1, 9], dtype=np.int64), np.array([0, 6, 2], dtype=np.int64),
                    np.array([0, 0, 0], dtype=np.int64), None)
            c.calls = [("compute", one, w, np.int64, True), ("check", one, w, np.int64, 0),
                       ("compute", multi, w, np.uint64, True), ("check", multi, w, np.uint64, 5),
                       ("flip", 1, kinds - 1, 12345), ("check", one, w, np.int64, 0),
                       ("compute", badr, w, np.int64, True), ("check", badr, w, np.int64, 3)]
            out.append(c)
    return out


@dataclass
class Run:
    outputs: list  # per compute / check call: a tuple of host arrays


def _flip(case: DigestCase, placed: list, arrays: list, lay: int, k: int, at: int) -> None:
    target = placed[k][lay]
    flat_n = arrays[k][lay].size
    idx = np.unravel_index(at % flat_n, arrays[k][lay].shape)
    arrays[k][lay][idx] ^= 0x10
    target[idx] = int(arrays[k][lay][idx])


def run_case(case: DigestCase, backend: str, place, launch_config=None, oracle_check: bool = False) -> Run:
    """Run ``case`` on ``backend`` with arrays made by ``place`` (``np.array`` copies for host backends)."""
    from canary.backends.args import DEFAULT_LAUNCH

    rng = np.random.default_rng(case.seed + 99)
    arrays = base_arrays(case)
    placed = place_all(case, arrays, place)
    bd = BlockDigest(layer_tensors(case, placed), layer_offset=case.layer_offset, head_offset=case.head_offset,
                     max_blocks=case.max_blocks, backend=backend, launch_config=launch_config or DEFAULT_LAUNCH)
    bd.warmup()
    outputs = []
    last = {}
    for call in case.calls:
        if call[0] == "flip":
            _flip(case, placed, arrays, *call[1:])
            continue
        kind, (indptr, indices, positions, lens), widths, out_dtype, extra = call
        nb = positions.shape[0]
        # int32 arrays hold the values' low 32 bits (the oracle reads what the kernels read)
        indptr, indices, positions = (indptr.astype(widths["kv_indptr"]), indices.astype(widths["kv_indices"]),
                                      positions.astype(widths["block_positions"]))
        lens = None if lens is None else lens.astype(widths["block_lens"])
        ins = dict(kv_indptr=place(indptr), kv_indices=place(indices), block_positions=place(positions),
                   block_lens=None if lens is None else place(lens))
        if kind == "compute":
            out = place(rng.integers(0, 1 << 63, nb, dtype=np.int64).astype(out_dtype))
            status = place(rng.integers(0, 256, nb, dtype=np.uint8)) if extra else None
            bd.compute(**ins, out=out, status=status)
            got = (np.asarray(to_host(out)).copy(), None if status is None else np.asarray(to_host(status)).copy())
            outputs.append(got)
            last[nb] = got[0].view(np.uint64)
            if oracle_check:
                want = oracle(case, arrays, indptr, indices, positions, lens)
                assert got[0].view(np.int64).tolist() == want[0], f"{case}: digests differ from the oracle"
                if status is not None:
                    assert got[1].tolist() == want[1], f"{case}: status differs from the oracle"
        else:
            mask_rng = np.random.default_rng(extra)
            exp = last.get(nb, mask_rng.integers(0, 1 << 63, nb, dtype=np.int64).view(np.uint64)).copy()
            if extra:
                exp ^= (mask_rng.random(nb) < 0.3).astype(np.uint64) << np.uint64(int(mask_rng.integers(0, 64)))
                exp[mask_rng.random(nb) < 0.2] = np.uint64(BAD_DIGEST & MASK)
            mm = place(rng.integers(0, 256, nb, dtype=np.uint8))
            count = place(np.array([int(rng.integers(-5, 5))], dtype=widths["count"]))
            bd.check(**ins, expected=place(exp.view(out_dtype)), mismatch_out=mm, count_out=count)
            outputs.append((np.asarray(to_host(mm)).copy(), np.asarray(to_host(count)).copy()))
    return Run(outputs)


def assert_twin(case: DigestCase, got: Run, want: Run) -> None:
    assert len(got.outputs) == len(want.outputs)
    for i, (g, w) in enumerate(zip(got.outputs, want.outputs)):
        for a, b in zip(g, w):
            if a is None or b is None:
                assert a is b, f"{case}: call {i}"
                continue
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{case}: call {i} differs: {a} != {b}"
