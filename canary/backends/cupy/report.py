"""CuPy launch of ``kernels/report.cu``: the manager's step report, written by the device into pinned host memory
(canary/manager/mailbox.py, ``CudaMailbox``). Packed once; a call rewrites the two per-step words."""
from __future__ import annotations

from ...contract.report_layout import REPORT_FIELDS as FIELDS
from ...contract.report_layout import REPORT_THREADS as THREADS
from . import OnDevice, Params, Streams, cupy, raw_module

_RPI, _BS = FIELDS.index("rpi"), FIELDS.index("bs")


class ReportLaunch:
    """``launch(rpi_ptr, bs, stream)`` copies the block at ``block_ptr`` (``words`` int64) and ``bs`` words at
    ``rpi_ptr`` into the next of ``slots`` mailbox slots of ``slot_words`` at ``mailbox_ptr`` (pinned), clears the
    first ``index_words`` of the block and publishes the slot; ``counter_ptr``: one device int64, zero at first."""

    def __init__(self, device_id: int, *, block_ptr: int, words: int, index_words: int, mailbox_ptr: int,
                 slot_words: int, slots: int, counter_ptr: int):
        with cupy.cuda.Device(device_id):
            self._fn = raw_module("report").get_function("canary_report").kernel
        self._params = Params(FIELDS, dict(block=block_ptr, words=words, rpi=0, bs=0, index_words=index_words,
                                           mailbox=mailbox_ptr, slot_words=slot_words, slots=slots,
                                           counter=counter_ptr))
        self._words, self._args = self._params.words, self._params.args
        self._streams = Streams()
        self.device_id = device_id

    def launch(self, rpi_ptr: int, bs: int, stream: int) -> None:
        w = self._words
        w[_RPI], w[_BS] = rpi_ptr, bs
        with OnDevice(self.device_id):  # the module's function belongs to this device's context
            self._fn((1,), (THREADS,), self._args, stream=self._streams.get_stream(stream))
