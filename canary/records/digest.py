"""A digest of KV bytes in flight (SPEC 4.2): :class:`BlockDigest`, bound once to the layers' K and V tensors.

The sender calls :meth:`BlockDigest.compute` on the blocks it is about to move (offload to host memory, ship from
prefill to decode) and sends the digests with them; the receiver, once the bytes landed, calls
:meth:`BlockDigest.check` with those digests and gets a mismatch byte per block and a count, on the device. Each
lane (8 bytes of a head) is mixed with a key from its layer, K or V, head, position and lane index before the
lanes are summed mod 2^64, so the digest does not depend on where the block sits (pages, slots, head order), and
tensor-parallel ranks' partial digests over their own heads (``head_offset``) add up to the block's
(:func:`canary.combine_digests`; on a device a wrapping add).

Backends as :class:`~canary.CanaryRecords`: the NumPy reference for host arrays, the CuPy kernel of
``kernels/digest.cu`` and its Numba twin ``kernels/digest_numba.py`` for CUDA arrays; one launch a call on the
caller's stream, graph-capturable, nothing allocated after :meth:`BlockDigest.warmup`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import backends
from ..backends.args import DEFAULT_LAUNCH, DigestArgs, LaunchConfig
from ..errors import fail
from ..interop.adapter import HOST, INT_WIDTHS, ArrayView
from ..interop.callviews import CallViews
from ..interop.overlap import check_disjoint, spans
from ..contract.digest import DigestLayers, digest_layers

DIGEST_DTYPES = (np.dtype(np.int64), np.dtype(np.uint64))
UINT8 = np.dtype(np.uint8)
DEFAULT_MAX_BLOCKS = 1 << 16


def _where(device_id: int) -> str:
    return "host memory" if device_id == HOST else f"cuda:{device_id}"


class BlockDigest:
    """The block digest bound to a model's KV tensors (SPEC 4.2).

    ``layers``: ``num_layers`` items (1 to 65536), each ``[k, v]`` (or ``[kv]`` for one tensor a layer, MLA's latent
    cache), every tensor ``[num_pages, page_size, heads, head_dim]`` or token-major ``[num_slots, heads, head_dim]``,
    any dtype, last axis contiguous, other byte strides multiples of 16 (NHD or HND pages: pass the view whose axes
    read pages, tokens, heads); one layout per kind across layers; or a :class:`~canary.contract.digest.DigestLayers`.
    ``layer_offset`` / ``head_offset``: the global index of the first layer / head these tensors hold (a pipeline
    stage, a tensor-parallel rank). ``max_blocks``: the most blocks a call may name (the scratch, allocated at bind:
    16 bytes a block). ``backend``: "auto", "reference", "cupy", "numba".

    Calls of one ``BlockDigest`` share its scratch: one call at a time (on one stream; another stream needs another
    ``BlockDigest``). The tensors must stay alive and in place. Raises ``TypeError`` / ``ValueError``
    (``kv-canary:``, naming the argument) for bad arguments, :class:`~canary.errors.BackendUnavailableError` when the
    backend's library is missing.
    """

    def __init__(self, layers: Any, *, layer_offset: int = 0, head_offset: int = 0,
                 max_blocks: int = DEFAULT_MAX_BLOCKS, backend: str = "auto",
                 launch_config: LaunchConfig = DEFAULT_LAUNCH):
        self.layers: DigestLayers = digest_layers(layers, layer_offset=layer_offset, head_offset=head_offset)
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, (int, np.integer)):
            raise fail(TypeError, f"max_blocks: expected an int, got {type(max_blocks).__name__}")
        if not 1 <= int(max_blocks) <= (1 << 40):
            raise fail(ValueError, f"max_blocks: expected an int in [1, 2**40], got {max_blocks}")
        if not isinstance(launch_config, LaunchConfig):
            raise fail(TypeError, f"launch_config: expected a LaunchConfig, got {type(launch_config).__name__}")
        self.max_blocks = int(max_blocks)
        self.device_id = self.layers.device_id
        first = self.layers.layers[0][0]
        self._owner = first.owner
        self._tensors = [(ArrayView(t.name, t.ptr, (t.span_bytes,), (1,), UINT8, t.device_id, True, t.owner),
                          t.span_bytes) for layer in self.layers.layers for t in layer]
        self._views: dict = {}
        self._module = backends.resolve(backend, self.device_id, family="digest")
        self.backend = self._module.NAME
        self._bound = self._module.bind(self.layers, self.max_blocks, launch_config)

    @property
    def num_layers(self) -> int:
        return self.layers.num_layers

    def warmup(self) -> None:
        """Compile and load the kernel, so that later calls only launch (graph-capturable)."""
        self._bound.warmup()

    def _blocks(self, go: CallViews, kv_indptr, kv_indices, block_positions, block_lens) -> tuple:
        pos = go.vec(block_positions, "block_positions", INT_WIDTHS)
        nb = pos.shape[0]
        if nb > self.max_blocks:
            raise fail(ValueError, f"block_positions: expected at most max_blocks = {self.max_blocks} blocks, "
                                   f"got {nb}")
        ptr = go.vec(kv_indptr, "kv_indptr", INT_WIDTHS)
        if ptr.shape[0] < nb + 1:
            raise fail(ValueError, f"kv_indptr: expected length >= num_blocks + 1 = {nb + 1}, got {ptr.shape[0]}")
        idx = go.vec(kv_indices, "kv_indices", INT_WIDTHS)
        lens = None if block_lens is None else go.vec(block_lens, "block_lens", INT_WIDTHS, length=nb)
        return ptr, idx, pos, lens

    def _finish(self, inputs: list, outputs: list) -> None:
        for v in inputs + outputs:
            if v.device_id != self.device_id:
                raise fail(ValueError, f"{v.name}: expected the device of layers[0][0] ({_where(self.device_id)}), "
                                       f"got {v.where}")
        check_disjoint(spans(outputs), spans(inputs) + self._tensors)

    def compute(self, *, kv_indptr: Any, kv_indices: Any, block_positions: Any, out: Any, block_lens: Any = None,
                status: Any = None, stream: Any = None) -> None:
        """Write each block's digest (SPEC 4.2).

        ``block_positions`` ``[nb]`` (the position of each block's first token; ``nb <= max_blocks``), ``kv_indptr``
        ``[>= nb + 1]`` and ``kv_indices`` ``[nnz]`` (block ``b`` owns the pages ``kv_indices[kv_indptr[b] :
        kv_indptr[b + 1]]``), ``block_lens`` ``[nb]`` (tokens of each block; default: all its pages' tokens): each
        int32 or int64. ``out`` ``[nb]`` int64 or uint64 (written): the digests, ``BAD_DIGEST`` (-2**63) for a bad
        block; ``status`` ``[nb]`` uint8 (optional, written): ``DigestStatus`` bits ``BAD_PAGE`` / ``BAD_RANGE``.
        ``stream``: where the kernel runs (default: the current stream of the tensors' library; host arrays take
        none). Never syncs. ``TypeError`` / ``ValueError`` before any launch, among them for an output sharing memory
        with an input, a tensor or another output."""
        go = CallViews(self.device_id, stream, self._owner, None, self._views)
        ptr, idx, pos, lens = self._blocks(go, kv_indptr, kv_indices, block_positions, block_lens)
        nb = pos.shape[0]
        o = go.vec(out, "out", DIGEST_DTYPES, length=nb, writable=True)
        st = None if status is None else go.vec(status, "status", UINT8, length=nb, writable=True)
        self._finish([v for v in (ptr, idx, pos, lens) if v is not None], [v for v in (o, st) if v is not None])
        self._bound.compute(DigestArgs(ptr, idx, pos, lens, out=o, status=st), go.handle)

    def check(self, *, kv_indptr: Any, kv_indices: Any, block_positions: Any, expected: Any, mismatch_out: Any,
              count_out: Any, block_lens: Any = None, stream: Any = None) -> None:
        """Compare each block's digest with ``expected`` ``[nb]`` (int64 or uint64, what the sender's
        :meth:`compute` wrote) (SPEC 4.2). Blocks as in :meth:`compute`. ``mismatch_out`` ``[nb]`` uint8 (written):
        ``DigestStatus`` bits (0: the block matches); ``count_out`` ``[1]`` int32 or int64 (written): the blocks
        whose byte is not 0. Never syncs; errors as in :meth:`compute`."""
        go = CallViews(self.device_id, stream, self._owner, None, self._views)
        ptr, idx, pos, lens = self._blocks(go, kv_indptr, kv_indices, block_positions, block_lens)
        nb = pos.shape[0]
        exp = go.vec(expected, "expected", DIGEST_DTYPES, length=nb)
        mm = go.vec(mismatch_out, "mismatch_out", UINT8, length=nb, writable=True)
        cnt = go.vec(count_out, "count_out", INT_WIDTHS, length=1, writable=True)
        self._finish([v for v in (ptr, idx, pos, lens, exp) if v is not None], [mm, cnt])
        self._bound.check(DigestArgs(ptr, idx, pos, lens, expected=exp, mismatch=mm, count=cnt), go.handle)
