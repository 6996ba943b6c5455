"""The block digest (SPEC 4.2, canary/records/digest.py): the reference against a lane-by-lane oracle, the
properties the digest promises (a), (b), (c), bad input, argument errors, the CUDA struct layout and compile
checks. The Numba twin in the simulator is ``digest_sim_suite.py``; the GPU twins are ``test_digest_gpu.py``."""
from __future__ import annotations

import importlib.util
import itertools
import re

import numpy as np
import pytest
from helpers import digest_cases as dc

from canary import BAD_DIGEST, BlockDigest, DigestStatus, combine_digests
from canary.backends.sources import cuda_source
from canary.contract.digest import DIGEST_KEY0, head_keys

BAD = np.uint64(BAD_DIGEST & dc.MASK)


def _digest(layers, indptr, indices, positions, lens=None, **kw) -> np.ndarray:
    bd = BlockDigest(layers, max_blocks=max(1, len(positions)), **kw)
    out = np.zeros(len(positions), dtype=np.uint64)
    bd.compute(kv_indptr=np.asarray(indptr, np.int64), kv_indices=np.asarray(indices, np.int64),
               block_positions=np.asarray(positions, np.int64), out=out,
               block_lens=None if lens is None else np.asarray(lens, np.int64))
    return out


def _one_page_blocks(n: int, position: int = 0):
    return np.arange(n + 1), np.arange(n), np.full(n, position)


# ---- the rule


def test_constants_and_head_keys_follow_spec():
    assert DIGEST_KEY0 == dc.s(0xB10CD16E57C0FFEE)
    want = [dc.mix3(0xB10CD16E57C0FFEE, 2 * 5 + 1, 7 + h) for h in range(3)]
    assert head_keys(5, 1, 3, head_offset=7).tolist() == want


@pytest.mark.parametrize("case", dc.hand_cases(), ids=repr)
def test_reference_matches_the_oracle_on_hand_cases(case):
    dc.run_case(case, "reference", np.array, oracle_check=True)


@pytest.mark.parametrize("seed", range(12))
def test_reference_matches_the_oracle_on_random_cases(seed):
    dc.run_case(dc.random_case(seed), "reference", np.array, oracle_check=True)


# ---- (a) every single flip and every pair of same-bit flips in two lanes changes the digest


def _variants_block(rng, layers: int, kinds: int, heads: int, head_bytes: int, ps: int):
    """The original block (page 0) and room for variants: ``[layers][kinds]`` arrays ``[pages, ps, heads, hb]``."""
    return rng.integers(0, 256, (layers, kinds, 1, ps, heads, head_bytes), dtype=np.uint8)


def test_every_single_flip_and_every_same_bit_pair_changes_the_digest():
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=6, deadline=None)
    @hypothesis.given(seed=hypothesis.strategies.integers(0, 2**32 - 1),
                      zeros=hypothesis.strategies.booleans())
    def check(seed, zeros):
        rng = np.random.default_rng(seed)
        L, K, H, HB, PS = 2, 2, 1, 16, 2  # 16 lanes: 2 layers x 2 kinds x 2 tokens x 1 head x 2 lanes
        orig = _variants_block(rng, L, K, H, HB, PS)
        if zeros:
            orig[:] = 0  # the structured case: every lane's word is 0
        lanes = [(lay, k, t, h, i) for lay in range(L) for k in range(K) for t in range(PS) for h in range(H)
                 for i in range(HB // 8)]
        variants = [()] + [((a, b),) for a in range(len(lanes)) for b in range(64)]
        variants += [((a, b), (c, b)) for a, c in itertools.combinations(range(len(lanes)), 2) for b in range(64)]
        pages = np.repeat(orig, len(variants), axis=2)
        words = pages.view("<u8")  # [L, K, pages, PS, H, lanes]
        for v, flips in enumerate(variants):
            for lane, bit in flips:
                lay, k, t, h, i = lanes[lane]
                words[lay, k, v, t, h, i] ^= np.uint64(1) << np.uint64(bit)
        layers = [[pages[lay, k] for k in range(K)] for lay in range(L)]
        d = _digest(layers, *_one_page_blocks(len(variants), position=int(rng.integers(0, 1 << 30))))
        assert (d[1:] != d[0]).all(), [variants[i] for i in np.flatnonzero(d == d[0]) if i]

    check()


# ---- (b) layers, heads, positions, zeros: every lane keyed anew


def test_swapped_layers_heads_tokens_a_shift_and_zeros_change_the_digest():
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=20, deadline=None)
    @hypothesis.given(seed=hypothesis.strategies.integers(0, 2**32 - 1))
    def check(seed):
        rng = np.random.default_rng(seed)
        L, K, H, HB, PS = 2, 2, 2, 32, 2
        pages = np.repeat(_variants_block(rng, L, K, H, HB, PS), 6, axis=2)  # page 0: the original
        pages[:, :, 1] = pages[::-1, :, 0]  # the two layers' bytes swapped
        pages[:, :, 2] = pages[:, :, 0, :, ::-1]  # the two heads swapped
        pages[:, :, 3] = pages[:, :, 0, ::-1]  # the two tokens swapped
        pages[:, :, 4] = 0  # all zero
        pages[:, :, 5] = pages[:, ::-1, 0]  # K and V swapped
        layers = [[pages[lay, k] for k in range(K)] for lay in range(L)]
        p = int(rng.integers(0, 1 << 40))
        d = _digest(layers, np.arange(8), [0, 1, 2, 3, 4, 5, 0], [p] * 6 + [p + 1])
        assert len(set(d.tolist())) == 7, d  # the original differs from each, the shifted block too

    check()


def test_a_block_at_the_wrong_position_or_layer_offset_does_not_match():
    rng = np.random.default_rng(3)
    k = rng.integers(0, 256, (4, 2, 2, 16), dtype=np.uint8)
    base = _digest([[k]], [0, 2], [1, 3], [10])
    assert _digest([[k]], [0, 2], [1, 3], [11]) != base
    assert _digest([[k]], [0, 2], [1, 3], [10], layer_offset=1) != base
    assert _digest([[k]], [0, 2], [1, 3], [10], head_offset=2) != base
    assert _digest([[k]], [0, 2], [3, 1], [10]) != base  # its pages in the other order


# ---- (c) composable: partial digests add up, the layout does not matter


@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_partials_sum_to_the_full_digest(ranks):
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=15, deadline=None)
    @hypothesis.given(seed=hypothesis.strategies.integers(0, 2**32 - 1))
    def check(seed):
        rng = np.random.default_rng(seed)
        H = 8
        k = rng.integers(0, 256, (3, 6, 4, H, 16), dtype=np.uint8)
        v = rng.integers(0, 256, (3, 6, 4, H, 32), dtype=np.uint8)
        blocks = dc.random_blocks(rng, dc.DigestCase("c", 0, 3, 2, 6, 4, (H, H), (16, 32), max_blocks=8), bad=False)
        full = _digest([[k[i], v[i]] for i in range(3)], *blocks)
        cuts = np.sort(rng.choice(np.arange(1, H), ranks - 1, replace=False))
        bounds = list(zip([0, *cuts], [*cuts, H]))
        parts = []
        for lo, hi in bounds:
            # each rank's own tensors: its heads only, in memory of its own (a copy, HND for odd ranks)
            rk = [np.ascontiguousarray(k[i][:, :, lo:hi]) for i in range(3)]
            rv = [np.ascontiguousarray(v[i][:, :, lo:hi].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                  for i in range(3)]
            parts.append(_digest([[rk[i], rv[i]] for i in range(3)], *blocks, head_offset=int(lo)))
        order = rng.permutation(len(parts))
        assert combine_digests([parts[i] for i in order]).view(np.uint64).tolist() == full.tolist()
        acc = np.zeros_like(full)
        for i in order:
            acc += parts[i]  # on a device: a plain wrapping add
        assert acc.tolist() == full.tolist()

    check()


def test_pipeline_stages_partials_sum_to_the_full_digest():
    rng = np.random.default_rng(5)
    k = rng.integers(0, 256, (4, 5, 2, 2, 16), dtype=np.uint8)
    blocks = ([0, 2, 3], [4, 1, 0], [0, 9])
    full = _digest([[k[i]] for i in range(4)], *blocks)
    parts = [_digest([[k[i]] for i in range(0, 1)], *blocks), _digest([[k[i]] for i in range(1, 4)], *blocks,
                                                                      layer_offset=1)]
    assert (parts[0] + parts[1]).tolist() == full.tolist()


def test_one_logical_block_under_different_layouts_and_placements_has_one_digest():
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=15, deadline=None)
    @hypothesis.given(seed=hypothesis.strategies.integers(0, 2**32 - 1))
    def check(seed):
        rng = np.random.default_rng(seed)
        T, H, HB, L = 8, 3, 32, 2
        tokens = rng.integers(0, 256, (L, 2, T, H, HB), dtype=np.uint8)  # the logical block: layer, kind, token
        pos = int(rng.integers(0, 1 << 30))
        got = []
        for ps, layout in ((4, "nhd"), (4, "hnd"), (2, "nhd"), (1, "token"), (8, "padded")):
            pages = T // ps
            where = rng.permutation(pages + 3)[:pages]  # its pages among others, in any order
            layers = []
            for lay in range(L):
                kinds = []
                for kind in range(2):
                    pool = rng.integers(0, 256, (pages + 3, ps, H, HB), dtype=np.uint8)
                    pool[where] = tokens[lay, kind].reshape(pages, ps, H, HB)
                    if layout == "hnd":
                        pool = np.ascontiguousarray(pool.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                    elif layout == "token":
                        pool = pool[:, 0]
                    elif layout == "padded":
                        wide = np.zeros((pages + 3, ps, H + 2, HB + 32), dtype=np.uint8)
                        wide[:, :, 1:H + 1, 16:HB + 16] = pool
                        pool = wide[:, :, 1:H + 1, 16:HB + 16]
                    kinds.append(pool)
                layers.append(kinds)
            got.append(int(_digest(layers, [0, pages], where, [pos])[0]))
        assert len(set(got)) == 1, got

    check()


def test_empty_blocks_digest_to_zero_and_lens_cut_a_partial_page():
    rng = np.random.default_rng(1)
    k = rng.integers(0, 256, (3, 4, 1, 16), dtype=np.uint8)
    d = _digest([[k]], [0, 0, 1, 1, 1], [2], [0, 0, 0, 0], lens=[0, 3, 0, 0])
    assert d[0] == 0 and d[2] == 0 and d[3] == 0 and d[1] != 0
    k2 = k.copy()
    k2[2, 3] ^= 1  # the fourth token, past the length: not read
    assert _digest([[k2]], [0, 1], [2], [0], lens=[3])[0] == d[1]


# ---- bad input


def test_bad_pages_pairs_and_lengths_set_status_and_the_bad_digest():
    k = np.ones((4, 2, 1, 16), dtype=np.uint8)
    bd = BlockDigest([[k]], max_blocks=8)
    indptr = np.array([0, 1, 2, 4, 3, 4, 5, 6], np.int64)
    indices = np.array([0, -1, 4, 1, 2, 1 << 40], np.int64)
    pos = np.zeros(7, np.int64)
    lens = np.array([2, 1, 1, 0, 1, 3, 0], np.int32)
    out = np.zeros(7, np.int64)
    status = np.full(7, 99, np.uint8)
    bd.compute(kv_indptr=indptr, kv_indices=indices, block_positions=pos, out=out, status=status, block_lens=lens)
    B, R = int(DigestStatus.BAD_PAGE), int(DigestStatus.BAD_RANGE)
    assert status.tolist() == [0, B, B, R, 0, R, 0]
    assert [o == BAD_DIGEST for o in out.tolist()] == [False, True, True, True, False, True, False]
    assert out[6] == 0  # a block of no tokens (its bad page is never read)
    mm = np.zeros(7, np.uint8)
    count = np.zeros(1, np.int64)
    exp = out.copy()
    exp[4] ^= 8
    exp[0] = BAD_DIGEST
    bd.check(kv_indptr=indptr, kv_indices=indices, block_positions=pos, expected=exp, mismatch_out=mm,
             count_out=count, block_lens=lens)
    D, E = int(DigestStatus.DIFFERS), int(DigestStatus.EXPECTED_BAD)
    # a bad block never passes, not even against its own BAD_DIGEST
    assert mm.tolist() == [D | E, B | E, B | E, R | E, D, R | E, 0] and count[0] == 6


def test_combine_digests_keeps_bad_and_checks_its_arguments():
    a = np.array([1, BAD_DIGEST, -1], np.int64)
    b = np.array([2, 5, 2], np.uint64)
    assert combine_digests([a, b]).tolist() == [3, BAD_DIGEST, 1]
    with pytest.raises(ValueError, match="kv-canary: parts: expected at least one"):
        combine_digests([])
    with pytest.raises(TypeError, match=r"kv-canary: parts\[1\]: expected dtype int64 or uint64, got int32"):
        combine_digests([a, a.astype(np.int32)])
    with pytest.raises(ValueError, match=r"kv-canary: parts\[1\]: expected shape \(3,\)"):
        combine_digests([a, b[:2]])


# ---- argument errors


def test_argument_errors_name_the_argument():
    k = np.zeros((4, 2, 2, 16), np.uint8)
    with pytest.raises(ValueError, match=r"kv-canary: layers\[0\]\[0\]: expected a head of a multiple of 16 bytes"):
        BlockDigest([[np.zeros((4, 2, 2, 8), np.uint8)]])
    with pytest.raises(ValueError, match=r"kv-canary: layers\[1\]\[0\]: expected layers\[0\]\[0\]'s layout"):
        BlockDigest([[k], [np.zeros((5, 2, 2, 16), np.uint8)]])
    with pytest.raises(ValueError, match=r"kv-canary: layers\[0\]\[1\]: expected layers\[0\]\[0\]'s pages"):
        BlockDigest([[k, np.zeros((4, 1, 2, 16), np.uint8)]])
    with pytest.raises(ValueError, match=r"kv-canary: layers\[1\]: expected 1 tensors, as layers\[0\] has, got 2"):
        BlockDigest([[k], [k, k]])
    with pytest.raises(ValueError, match=r"kv-canary: layers\[0\]\[0\]: expected shape \[num_pages"):
        BlockDigest([[np.zeros((4, 16), np.uint8)]])
    with pytest.raises(ValueError, match=r"kv-canary: layers\[0\]\[0\]: expected a contiguous last axis"):
        BlockDigest([[np.zeros((4, 2, 16, 2), np.uint8).transpose(0, 1, 3, 2)]])
    with pytest.raises(ValueError, match=r"kv-canary: layers\[0\]\[0\]: expected a page stride that is a multiple"):
        BlockDigest([[np.zeros((4, 24), np.uint8)[:, :16].reshape(4, 1, 16)[:, :, :]]])
    with pytest.raises(ValueError, match=r"kv-canary: head_offset: expected an int in \[0, 2\*\*31\), got -1"):
        BlockDigest([[k]], head_offset=-1)
    with pytest.raises(TypeError, match="kv-canary: max_blocks: expected an int, got float"):
        BlockDigest([[k]], max_blocks=2.0)
    bd = BlockDigest([[k]], max_blocks=2)
    ok = dict(kv_indptr=np.array([0, 1]), kv_indices=np.array([0]), block_positions=np.array([0]))
    with pytest.raises(ValueError, match="kv-canary: block_positions: expected at most max_blocks = 2 blocks, got 3"):
        bd.compute(**{**ok, "block_positions": np.zeros(3, np.int64)}, out=np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="kv-canary: kv_indptr: expected length >= num_blocks"):
        bd.compute(**{**ok, "kv_indptr": np.array([0])}, out=np.zeros(1, np.int64))
    with pytest.raises(TypeError, match="kv-canary: kv_indices: expected dtype int32 or int64, got uint32"):
        bd.compute(**{**ok, "kv_indices": np.array([0], np.uint32)}, out=np.zeros(1, np.int64))
    with pytest.raises(TypeError, match="kv-canary: out: expected dtype int64 or uint64, got int32"):
        bd.compute(**ok, out=np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="kv-canary: out: expected length 1, got 2"):
        bd.compute(**ok, out=np.zeros(2, np.int64))
    with pytest.raises(TypeError, match="kv-canary: status: expected dtype uint8, got int8"):
        bd.compute(**ok, out=np.zeros(1, np.int64), status=np.zeros(1, np.int8))
    overlap = r"kv-canary: ({0}|{1}): expected memory separate from ({0}|{1})"
    with pytest.raises(ValueError, match=overlap.format("out", r"layers\[0\]\[0\]")):
        bd.compute(**ok, out=k.reshape(-1)[:8].view(np.int64))
    ro = np.zeros(1, np.int64)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="kv-canary: out: expected a writable output array"):
        bd.compute(**ok, out=ro)
    idx = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match=overlap.format("mismatch_out", "kv_indices")):
        bd.check(**{**ok, "kv_indices": idx[:1]}, expected=np.zeros(1, np.int64), mismatch_out=idx.view(np.uint8)[:1],
                 count_out=np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="kv-canary: count_out: expected length 1, got 2"):
        bd.check(**ok, expected=np.zeros(1, np.int64), mismatch_out=np.zeros(1, np.uint8),
                 count_out=np.zeros(2, np.int32))


# ---- the CUDA source


def test_digest_params_layout_matches_the_cuda_struct():
    from canary.contract.digest_layout import CONSTANTS, DIGEST_FIELDS

    src = cuda_source("digest")
    body = src[src.index("struct DigestParams {"):]
    body = body[body.index("{") + 1: body.index("};")]
    fields = []
    for line in body.splitlines():
        decl = line.split("//")[0].strip()
        if decl:
            m = re.fullmatch(r"(.*?)(\w+)(\[\w+\])?;", decl)
            assert "*" in m.group(1) or m.group(1).strip() in ("i64", "u64"), decl  # every field 8 bytes
            fields += [f"{m.group(2)}{k}" for k in range(2)] if m.group(3) else [m.group(2)]
    assert tuple(fields) == DIGEST_FIELDS
    for name, value in CONSTANTS.items():
        assert re.search(rf"#define {name} {value}\b", src), name


def _has_cuda_core() -> bool:
    try:
        return importlib.util.find_spec("cuda.core") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.sim
@pytest.mark.skipif(not _has_cuda_core(), reason="needs cuda-core for NVRTC: pip install -e '.[sim]'")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_digest_cu_compiles(arch):
    from cuda.core import Program, ProgramOptions

    cubin = Program(cuda_source("digest"), "c++", ProgramOptions(arch=arch, std="c++17")).compile("cubin").code
    assert b"canary_digest_check" in cubin and b"canary_digest" in cubin


@pytest.mark.sim
@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                    reason="needs numba-cuda: pip install -e '.[sim]'")
def test_numba_digest_kernels_compile_for_sm90():
    """The twin types and compiles in u64 arithmetic only (no float64), for 1 and 128 tensors. In a child: this
    process may hold the simulator."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import re\n"
        "from types import SimpleNamespace\n"
        "from numba import cuda\n"
        "import numba.cuda.dispatcher as dispatcher\n"
        "from numba.cuda.cudadrv import nvvm\n"
        "if not nvvm.is_available():\n"
        "    print('NO-NVVM'); raise SystemExit(0)\n"
        "from canary.backends.sources import numba_kernels\n"
        "dn = numba_kernels('digest_numba')\n"
        "dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))\n"
        "for n in (1, 128):\n"
        "    sig = 'void({})'.format(', '.join(ty.format(n) for _, ty in dn.DIGEST_ARGS))\n"
        "    for kernel in dn.kernel_functions():\n"
        "        ptx, _ = cuda.compile_ptx(kernel, sig, cc=(9, 0))\n"
        "        assert kernel.__name__ in ptx\n"
        "        assert not re.search(r'\\bcvt\\.rn\\.f64|\\.f64\\b', ptx), kernel.__name__\n"
        "print('OK')\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if proc.stdout.strip().endswith("NO-NVVM"):
        pytest.skip("NVVM unavailable")
    assert proc.stdout.strip().endswith("OK")
