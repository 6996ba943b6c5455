"""CuPy backend of the block digest: ``canary_digest`` / ``canary_digest_check`` of ``kernels/digest.cu``.

``bind`` copies the per-layer base-pointer table to the device and allocates the zeroed scratch (both once,
synchronous, at bind) and packs everything fixed into ``DigestParams`` words (:mod:`..digest_layout`); a call
rewrites the per-call words and launches once on the caller's stream: graph-capturable after :meth:`Bound.warmup`
(the grid and the splits come from the arrays' shapes).
"""
from __future__ import annotations

from ...contract.digest import DigestLayers
from ...contract.digest_layout import DIGEST_FIELDS, DIGEST_THREADS, digest_grid, digest_splits, scratch_words
from ..args import DEFAULT_LAUNCH, DigestArgs, LaunchConfig
from . import OnDevice, Params, Streams, cupy, load_functions

NAME = "cupy"
ON_DEVICE = True


def layout_words(layers: DigestLayers) -> dict:
    """``DigestParams``' fixed words: the layers, their layout per kind (kinds past ``num_kinds`` stay 0)."""
    out = dict(num_layers=layers.num_layers, num_kinds=layers.num_kinds, layer_offset=layers.layer_offset,
               head_offset=layers.head_offset, num_pages=layers.num_pages, page_size=layers.page_size)
    for k in range(layers.num_kinds):
        t = layers.kind(k)
        out.update({f"heads{k}": t.heads, f"head_vecs{k}": t.head_bytes // 16, f"page_stride{k}": t.page_stride,
                    f"token_stride{k}": t.token_stride, f"head_stride{k}": t.head_stride})
    return out


def units_per_token(layers: DigestLayers) -> int:
    """16-byte vectors of one token of the widest kind (what one (block, layer, kind) item reads a token)."""
    return max(layers.kind(k).heads * layers.kind(k).head_bytes // 16 for k in range(layers.num_kinds))


def call_words(a: DigestArgs) -> dict:
    """The per-call words (pointers of absent arrays are 0: null)."""
    ptr = lambda v: 0 if v is None else v.ptr  # noqa: E731
    return dict(kv_indptr=a.kv_indptr.ptr, kv_indices=a.kv_indices.ptr, block_positions=a.block_positions.ptr,
                block_lens=ptr(a.block_lens), num_blocks=a.num_blocks, nnz=a.kv_indices.shape[0],
                index_wide=a.index_wide, out=ptr(a.out), status_out=ptr(a.status), expected=ptr(a.expected),
                mismatch=ptr(a.mismatch), count_out=ptr(a.count))


class Bound:
    def __init__(self, layers: DigestLayers, max_blocks: int, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.layers = layers  # keeps the tensors alive while their pointers sit in the params
        self.device_id = layers.device_id
        with cupy.cuda.Device(self.device_id):
            self._bases = cupy.asarray(layers.base_pointers())
            self.scratch = cupy.zeros(scratch_words(max_blocks), dtype=cupy.uint64)  # zero between launches
        fixed = {**layout_words(layers), "layer_bases": self._bases.data.ptr, "scratch": self.scratch.data.ptr,
                 "scratch_blocks": int(max_blocks)}
        self._params = (Params(DIGEST_FIELDS, fixed), Params(DIGEST_FIELDS, fixed))
        self._units = units_per_token(layers)
        self._streams = Streams()
        self._fns = None

    def warmup(self) -> None:
        """Compile (once per process) and load the module on this device; later calls only launch."""
        if self._fns is not None:
            return
        fns, per_sm, sms = load_functions(self.device_id, "digest", (("canary_digest", DIGEST_THREADS),
                                                                     ("canary_digest_check", DIGEST_THREADS)))
        self._resident = tuple(sms * max(1, b) for b in per_sm)
        self._fns = fns

    def _launch(self, which: int, a: DigestArgs, stream: int) -> None:
        if self._fns is None:
            self.warmup()
        lay = self.layers
        resident = self._resident[which]
        splits = digest_splits(a.num_blocks, lay.num_layers, lay.num_kinds, a.kv_indices.shape[0] * lay.page_size,
                               self._units, resident)
        params = self._params[which]
        params.set({**call_words(a), "splits": splits})
        grid = digest_grid(a.num_blocks, lay.num_layers, lay.num_kinds, splits, resident)
        with OnDevice(self.device_id):
            self._fns[which]((grid,), (DIGEST_THREADS,), params.args, stream=self._streams.get_stream(stream))

    def compute(self, a: DigestArgs, stream: int) -> None:
        self._launch(0, a, stream)

    def check(self, a: DigestArgs, stream: int) -> None:
        self._launch(1, a, stream)


def bind(layers: DigestLayers, max_blocks: int, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(layers, max_blocks, launch)
