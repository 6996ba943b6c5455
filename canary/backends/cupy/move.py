"""CuPy backend of records that move: ``canary_gather_rows`` / ``canary_scatter_rows`` of ``kernels/records_move.cu``.

``bind`` packs the tables' and the status word's pointers into ``MoveParams`` words (:mod:`...contract.move_layout`)
once; a call rewrites the list and buffer words and launches once on the caller's stream (cuLaunchKernel copies
the words, so a copy's two launches share them): no allocation, compile, module load or sync after
:meth:`Bound.warmup`, so calls can be captured in a CUDA graph.
"""
from __future__ import annotations

from ...contract.move_layout import MOVE_FIELDS, MOVE_THREADS, move_grid
from ..args import DEFAULT_LAUNCH, LaunchConfig, MoveArgs, MoveTables
from . import OnDevice, Params, Streams, load_functions

NAME = "cupy"
ON_DEVICE = True


class Bound:
    def __init__(self, tables: MoveTables, launch: LaunchConfig = DEFAULT_LAUNCH):
        self.tables = tables  # keeps the views' owners alive while their pointers sit in the params
        self.device_id = tables.device_id
        t = tables
        fixed = dict(records=t.canary_buffer.ptr, num_slots=t.num_slots, slot_stride=t.slot_stride_bytes,
                     layer_hashes=0 if t.layer_hashes is None else t.layer_hashes.ptr, num_layers=t.num_layers,
                     status=t.status.ptr, slots=0, num_entries=0, slots_wide=0, rows=0, row_stride=0)
        self._params = (Params(MOVE_FIELDS, fixed), Params(MOVE_FIELDS, fixed))  # gather's, scatter's
        self._streams = Streams()
        self._fns = None

    def warmup(self) -> None:
        """Compile (once per process) and load the module on this device; later calls only launch."""
        if self._fns is None:
            self._fns, self._per_sm, self._sms = load_functions(
                self.device_id, "records_move",
                (("canary_gather_rows", MOVE_THREADS), ("canary_scatter_rows", MOVE_THREADS)))

    def _launch(self, k: int, a: MoveArgs, stream: int) -> None:
        if self._fns is None:
            self.warmup()
        n = a.slots.shape[0]
        params = self._params[k]
        params.set(dict(slots=a.slots.ptr, num_entries=n, slots_wide=a.slots_wide, rows=a.rows.ptr,
                        row_stride=a.row_stride))
        grid = move_grid(n, self.tables.row_words, self._sms, self._per_sm[k])
        with OnDevice(self.device_id):
            self._fns[k]((grid,), (MOVE_THREADS,), params.args, stream=self._streams.get_stream(stream))

    def gather(self, a: MoveArgs, stream: int) -> None:
        self._launch(0, a, stream)

    def scatter(self, a: MoveArgs, stream: int) -> None:
        self._launch(1, a, stream)


def bind(tables: MoveTables, launch: LaunchConfig = DEFAULT_LAUNCH) -> Bound:
    return Bound(tables, launch)
