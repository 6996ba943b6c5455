"""The block digest's GPU twins (``kernels/digest.cu`` through CuPy, ``kernels/digest_numba.py`` through numba-cuda)
against the NumPy reference, byte for byte, outputs poisoned before every call (SPEC 4.2): hand and random cases,
Hypothesis cases, large launches (many blocks; one long block split over the grid), a CUDA-graph capture replayed
after its inputs were refilled, torch bfloat16 tensors, a side stream. All marked ``gpu``."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import digest_cases as dc

from canary import BAD_DIGEST, BlockDigest

pytestmark = pytest.mark.gpu
TWINS = ["cupy", "numba"]


def _cupy():
    return pytest.importorskip("cupy")


def _twin(case, backend):
    cp = _cupy()
    want = dc.run_case(case, "reference", np.array)
    dc.assert_twin(case, dc.run_case(case, backend, cp.asarray), want)


@pytest.mark.parametrize("backend", TWINS)
@pytest.mark.parametrize("case", dc.hand_cases(), ids=repr)
def test_gpu_twins_match_the_reference_on_hand_cases(backend, case):
    _twin(case, backend)


@pytest.mark.parametrize("backend", TWINS)
@pytest.mark.parametrize("seed", range(100))
def test_gpu_twins_match_the_reference_on_random_cases(backend, seed):
    _twin(dc.random_case(seed), backend)


@pytest.mark.parametrize("backend", TWINS)
def test_gpu_twins_match_the_reference_hypothesis(backend):
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=50, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(seed=hypothesis.strategies.integers(1000, 2**32 - 1))
    def check(seed):
        _twin(dc.random_case(seed), backend)

    check()


def _model(cp, layers, pages, ps, heads, head_bytes, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.integers(0, 256, (layers, pages, ps, heads, head_bytes), dtype=np.uint8)
    v = rng.integers(0, 256, (layers, pages, ps, heads, head_bytes), dtype=np.uint8)
    return k, v, cp.asarray(k), cp.asarray(v)


def _compute(bd, xp, indptr, indices, positions, lens=None):
    out = xp.full(len(positions), 7, dtype=xp.int64)
    bd.compute(kv_indptr=xp.asarray(indptr), kv_indices=xp.asarray(indices), block_positions=xp.asarray(positions),
               block_lens=None if lens is None else xp.asarray(lens), out=out)
    return out


@pytest.mark.parametrize("backend", TWINS)
def test_gpu_many_blocks_and_one_long_block(backend):
    """256 one-page blocks of 16 tokens (many items, few splits), then one block of 1,024 tokens over 64 pages (few
    items, many splits over the grid): the reference's digests either way."""
    cp = _cupy()
    L, P, PS, H, HB = 4, 320, 16, 8, 256
    k, v, dk, dv = _model(cp, L, P, PS, H, HB)
    host = BlockDigest([[k[i], v[i]] for i in range(L)], max_blocks=256)
    dev = BlockDigest([[dk[i], dv[i]] for i in range(L)], max_blocks=256, backend=backend)
    rng = np.random.default_rng(1)
    pages = rng.permutation(P)[:256].astype(np.int64)
    blocks = (np.arange(257, dtype=np.int64), pages, np.arange(256, dtype=np.int64) * PS)
    assert cp.asnumpy(_compute(dev, cp, *blocks)).tolist() == _compute(host, np, *blocks).tolist()
    long = (np.array([0, 64]), pages[:64], np.array([12345]), np.array([64 * PS - 3]))
    assert cp.asnumpy(_compute(dev, cp, *long)).tolist() == _compute(host, np, *long).tolist()


@pytest.mark.parametrize("backend", ["cupy"])
def test_gpu_graph_capture_replays_after_refill(backend):
    """compute and check captured once on a side stream; the inputs refilled in place between replays (other
    pages, positions, a flipped byte): each replay gives the reference's outputs (the scratch is re-armed by every
    launch, nothing is reset between replays)."""
    cp = _cupy()
    L, P, PS, H, HB = 2, 40, 4, 2, 64
    k, v, dk, dv = _model(cp, L, P, PS, H, HB, seed=3)
    dev = BlockDigest([[dk[i], dv[i]] for i in range(L)], max_blocks=8, backend=backend)
    dev.warmup()
    nb = 8
    indptr = cp.arange(nb + 1, dtype=cp.int64)
    indices = cp.arange(nb, dtype=cp.int32)
    positions = cp.zeros(nb, dtype=cp.int64)
    out = cp.zeros(nb, dtype=cp.uint64)
    expected = cp.zeros(nb, dtype=cp.uint64)
    mm = cp.zeros(nb, dtype=cp.uint8)
    count = cp.zeros(1, dtype=cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        dev.compute(kv_indptr=indptr, kv_indices=indices, block_positions=positions, out=out, stream=stream)
        dev.check(kv_indptr=indptr, kv_indices=indices, block_positions=positions, expected=expected,
                  mismatch_out=mm, count_out=count, stream=stream)
        graph = stream.end_capture()
    rng = np.random.default_rng(4)
    for step in range(5):
        pages = rng.permutation(P)[:nb].astype(np.int32)
        pos = rng.integers(0, 1 << 20, nb).astype(np.int64)
        flips = rng.random(nb) < 0.5
        indices[...] = cp.asarray(pages)
        positions[...] = cp.asarray(pos)
        host = BlockDigest([[k[i], v[i]] for i in range(L)], max_blocks=8)
        want = _compute(host, np, np.arange(nb + 1), pages, pos).view(np.uint64)
        exp = want ^ flips.astype(np.uint64)
        expected[...] = cp.asarray(exp)
        graph.launch(stream)
        stream.synchronize()
        assert cp.asnumpy(out).tolist() == want.tolist(), step
        assert cp.asnumpy(mm).tolist() == flips.astype(np.uint8).tolist() and int(count[0]) == int(flips.sum())
        if step == 2:  # a byte changed in the device tensors: its block's digest changes, in both copies
            dk[1, int(pages[0]), 0, 1, 5] ^= 1
            k[1, int(pages[0]), 0, 1, 5] ^= 1


@pytest.mark.parametrize("backend", TWINS)
def test_gpu_torch_bfloat16_tensors_and_a_side_stream(backend):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    L, P, PS, H, D = 3, 12, 8, 4, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn((L, P, PS, H, D), device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn((L, P, H, PS, D), device="cuda", dtype=torch.bfloat16, generator=g).transpose(2, 3)  # HND
    dev = BlockDigest([[k[i], v[i]] for i in range(L)], max_blocks=4, backend=backend)
    hk = k.view(torch.uint8).cpu().numpy()
    hv = v.contiguous().view(torch.uint8).cpu().numpy()
    host = BlockDigest([[hk[i], hv[i]] for i in range(L)], max_blocks=4)
    indptr = torch.tensor([0, 2, 3, 3, 5], device="cuda", dtype=torch.int32)
    indices = torch.tensor([4, 1, 0, 11, 12], device="cuda", dtype=torch.int64)  # 12: past the pages
    positions = torch.tensor([0, 16, 24, 40], device="cuda", dtype=torch.int64)
    out = torch.zeros(4, device="cuda", dtype=torch.int64)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev.compute(kv_indptr=indptr, kv_indices=indices, block_positions=positions, out=out)
    stream.synchronize()
    want = _compute(host, np, indptr.cpu().numpy(), indices.cpu().numpy(), positions.cpu().numpy())
    assert out.cpu().numpy().tolist() == want.tolist()
    assert want[3] == BAD_DIGEST and want[2] == 0
