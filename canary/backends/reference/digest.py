"""NumPy reference of the block digest (SPEC 4.2): ``compute`` and ``check``.

The semantics ``kernels/digest.cu`` and ``kernels/digest_numba.py`` reproduce byte for byte. Inputs are validated
host arrays (:class:`canary.records.digest.BlockDigest` does that); outputs are written in place.

Vectorized over tokens: per (layer, kind) the tokens' heads are gathered as ``[T, heads, lanes]`` u64 words, keyed,
mixed and summed per token; a wrapping prefix sum over the tokens (grouped by block) gives each block's sum.
"""
from __future__ import annotations

import numpy as np

from ...contract.digest import BAD_DIGEST, LANE_BITS, DigestLayers, DigestStatus, DIGEST_LANE_MUL, head_keys
from ...contract.hashes import MASK64, splitmix64_inplace
from ..args import DEFAULT_LAUNCH, DigestArgs, LaunchConfig

NAME = "reference"
ON_DEVICE = False

_I64 = np.int64
_U64 = np.uint64
_BAD = np.uint64(BAD_DIGEST & MASK64)
_CHUNK_WORDS = 1 << 20  # u64 words gathered at a time (8 MiB): bounds the temporaries


def block_tokens(kv_indptr, kv_indices, block_positions, block_lens, page_size: int, num_pages: int):
    """Every token the blocks read: ``(owner block, page, in-page offset, position)`` of each, grouped by block in
    order, and the blocks' status (``BAD_RANGE``, ``BAD_PAGE``) and token counts. Arrays int32 or int64."""
    nb = block_positions.shape[0]
    nnz = kv_indices.shape[0]
    ptr = np.asarray(kv_indptr[: nb + 1]).astype(_I64)
    lo, hi = ptr[:nb], ptr[1 : nb + 1]
    ok = (lo >= 0) & (hi >= lo) & (hi <= nnz)
    cap = np.where(ok, hi - np.where(ok, lo, 0), 0) * page_size
    n = cap if block_lens is None else np.asarray(block_lens[:nb]).astype(_I64)
    ok &= (n >= 0) & (n <= cap)
    n = np.where(ok, n, 0)
    status = np.where(ok, 0, int(DigestStatus.BAD_RANGE)).astype(np.uint8)
    total = int(n.sum())
    owner = np.repeat(np.arange(nb, dtype=_I64), n)
    first = np.cumsum(n) - n
    j = np.arange(total, dtype=_I64) - first[owner]
    page = np.asarray(kv_indices).astype(_I64)[np.where(ok, lo, 0)[owner] + j // page_size] if total else \
        np.zeros(0, dtype=_I64)
    with np.errstate(over="ignore"):
        pos = np.asarray(block_positions).astype(_I64)[owner] + j  # int64 wraparound, as on the GPU
    bad = (page < 0) | (page >= num_pages)
    if bad.any():
        status[np.unique(owner[bad])] |= int(DigestStatus.BAD_PAGE)
    return owner, page, j % page_size, pos, status, n


def lane_sums(layers: DigestLayers, page: np.ndarray, offset: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``[T]`` uint64: each token's sum of lane values over every layer, kind, head and lane (pages in range)."""
    total = np.zeros(page.shape[0], dtype=_U64)
    if page.shape[0] == 0:
        return total
    mul = _U64(DIGEST_LANE_MUL)
    for li, layer in enumerate(layers.layers):
        for k, t in enumerate(layer):
            lanes = t.head_bytes // 8
            keys = head_keys(layers.layer_offset + li, k, t.heads, layers.head_offset)
            step = max(1, _CHUNK_WORDS // (t.heads * lanes))
            for a in range(0, page.shape[0], step):
                p, o = page[a : a + step], offset[a : a + step]
                words = t.words[p, o]  # [T, heads, lanes] little-endian u64
                x = (pos[a : a + step].view(_U64) << _U64(LANE_BITS))[:, None] + np.arange(lanes, dtype=_U64)
                v = keys[None, :, None] + (x * mul)[:, None, :]
                v ^= words
                splitmix64_inplace(v)
                total[a : a + step] += v.sum(axis=(1, 2), dtype=_U64)
    return total


def digests(layers: DigestLayers, a: DigestArgs) -> tuple[np.ndarray, np.ndarray]:
    """``([nb] uint64 digests, BAD_DIGEST where the status is not 0; [nb] uint8 status)``."""
    owner, page, offset, pos, status, n = block_tokens(
        a.kv_indptr.host, a.kv_indices.host, a.block_positions.host,
        None if a.block_lens is None else a.block_lens.host, layers.page_size, layers.num_pages)
    good = (page >= 0) & (page < layers.num_pages)
    sums = np.zeros(page.shape[0], dtype=_U64)
    sums[good] = lane_sums(layers, page[good], offset[good], pos[good])
    # Block sums as differences of a wrapping prefix sum over the tokens, grouped by block in order.
    prefix = np.concatenate([np.zeros(1, dtype=_U64), np.cumsum(sums, dtype=_U64)])
    end = np.cumsum(n)
    out = prefix[end] - prefix[end - n]
    out[status != 0] = _BAD
    return out, status


def compute(layers: DigestLayers, a: DigestArgs) -> None:
    d, status = digests(layers, a)
    a.out.host[:] = d.view(a.out.dtype)
    if a.status is not None:
        a.status.host[:] = status


def check(layers: DigestLayers, a: DigestArgs) -> None:
    d, status = digests(layers, a)
    expected = a.expected.host.view(_U64)
    flags = status | np.where(d != expected, int(DigestStatus.DIFFERS), 0).astype(np.uint8)
    flags |= np.where(expected == _BAD, int(DigestStatus.EXPECTED_BAD), 0).astype(np.uint8)
    a.mismatch.host[:] = flags
    a.count.host[0] = int(np.count_nonzero(flags))


class Bound:
    """The reference behind :class:`canary.records.digest.BlockDigest`."""

    def __init__(self, layers: DigestLayers, max_blocks: int, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.layers = layers

    def warmup(self) -> None:
        pass

    def compute(self, args: DigestArgs, stream: int = 0) -> None:
        compute(self.layers, args)

    def check(self, args: DigestArgs, stream: int = 0) -> None:
        check(self.layers, args)


def bind(layers: DigestLayers, max_blocks: int, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(layers, max_blocks, launch)
