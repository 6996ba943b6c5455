"""CuPy backend of the layer rotation: ``canary_write_layers`` / ``canary_verify_layer`` of ``kernels/records.cu``.

``bind`` copies the per-layer base-pointer table to the device once (a synchronous copy, at bind) and packs
everything fixed into ``LayerParams`` words (:mod:`..layers_layout`); a call rewrites the per-call words and
launches once on the caller's stream: graph-capturable after :meth:`Bound.warmup`.
"""
from __future__ import annotations

from ...contract.ring import KernelTag, encode_tag
from ...contract.state import StateViews
from ..args import DEFAULT_LAUNCH, LaunchConfig
from ...contract.layers_layout import LAYER_FIELDS, LAYER_THREADS, layer_grid
from . import OnDevice, Params, Streams, cupy, load_functions
from .records import real_kv_words, records_defines, state_words

NAME = "cupy"
ON_DEVICE = True


class Bound:
    def __init__(self, state: StateViews, views, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.state = state
        self.views = views  # keeps the sources and the table alive while their pointers sit in the params
        self.device_id = state.device_id
        with cupy.cuda.Device(self.device_id):
            self._bases = cupy.asarray(views.base_pointers)  # [L * S] int64, read by the kernels
        fixed = {**state_words(state), **real_kv_words(views.kv.layers[0]),
                 "layer_bases": self._bases.data.ptr, "num_layers": views.num_layers, "dwell": views.dwell,
                 "layer_hashes": views.layer_hashes.ptr, "layer_cursor": views.layer_cursor.ptr}
        self._write = Params(LAYER_FIELDS, fixed)
        self._verify = Params(LAYER_FIELDS, fixed)
        self._write.set({"tag": encode_tag(KernelTag.WRITE)})
        self._streams = Streams()
        self._fns = None

    def warmup(self) -> None:
        if self._fns is not None:
            return
        self._fns, self._per_sm, self._sms = load_functions(
            self.device_id, "records", (("canary_write_layers", LAYER_THREADS), ("canary_verify_layer", LAYER_THREADS)),
            records_defines(self.state))

    def write(self, plan, out_cache_loc, stream: int) -> None:
        if self._fns is None:
            self.warmup()
        n = out_cache_loc.shape[0]
        self._write.set(dict(
            write_offsets=plan.write_offsets.ptr, write_seed_slot_indices=plan.write_seed_slot_indices.ptr,
            write_num_valid_reqs=plan.write_num_valid_reqs.ptr,
            write_req_capacity=plan.write_seed_slot_indices.shape[0], out_cache_loc=out_cache_loc.ptr, num_entries=n,
            entry_wide=int(out_cache_loc.dtype.itemsize == 8),  # ENTRY_WIDE_OUT_CACHE_LOC
        ))
        grid = layer_grid(n * self.views.num_layers, self._sms, self._per_sm[0])
        with OnDevice(self.device_id):
            self._fns[0]((grid,), (LAYER_THREADS,), self._write.args, stream=self._streams.get_stream(stream))

    def verify(self, plan, tag: int, stream: int) -> None:
        if self._fns is None:
            self.warmup()
        cap = plan.verify_slot_indices.shape[0]
        self._verify.set(dict(
            tag=tag, verify_slot_indices=plan.verify_slot_indices.ptr,
            verify_expected_tokens=plan.verify_expected_tokens.ptr,
            verify_expected_positions=plan.verify_expected_positions.ptr, verify_capacity=cap,
            verify_num_valid=plan.verify_num_valid.ptr, enable=plan.enable.ptr,
        ))
        grid = layer_grid(cap, self._sms, self._per_sm[1])
        with OnDevice(self.device_id):
            self._fns[1]((grid,), (LAYER_THREADS,), self._verify.args, stream=self._streams.get_stream(stream))


def bind(state: StateViews, views, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(state, views, launch)
