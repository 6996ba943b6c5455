"""CuPy launch of ``kernels/agree.cu``: a GPU manager's agreement words of one group (SPEC 4.3,
canary/manager/distributed.py). Compiled, loaded and packed once at construction (the verify plan's arrays and the
report-block words never move); a call rewrites the five per-call words and launches once on the caller's stream:
graph-capturable (the grid comes from the entries' length and the plan's capacity)."""
from __future__ import annotations

from ...contract.agree_layout import AGREE_FIELDS as FIELDS
from ...contract.agree_layout import AGREE_THREADS as THREADS
from ...contract.agree_layout import AGREE_WIDE, agree_grid
from . import OnDevice, Params, Streams, load_functions

_SLOTS, _TOKENS, _POSITIONS, _N, _WIDE = (FIELDS.index(f) for f in ("slots", "tokens", "positions", "n",
                                                                    "entry_wide"))
_WIDE_BITS = tuple(AGREE_WIDE[k] for k in ("slots", "tokens", "positions"))


class AgreeLaunch:
    """``launch(slots, tokens, positions, stream)`` adds the digests of the plan ``plan`` (``(slots, tokens,
    positions, num_valid)`` views: ``[C]`` int64, ``[1]`` int32) and of the call's entries (``[n]`` int32 / int64
    views) into ``out`` (a ``[2]`` int64 view: the group's report-block words)."""

    def __init__(self, device_id: int, *, plan: tuple, out):
        slots, tokens, positions, num_valid = plan
        (self._fn,), (per_sm,), sms = load_functions(device_id, "agree", (("canary_agree", THREADS),))
        self._resident = sms * max(1, per_sm)
        self._capacity = int(slots.shape[0])
        self._params = Params(FIELDS, dict(slots=0, tokens=0, positions=0, n=0, entry_wide=0, plan_slots=slots.ptr,
                                           plan_tokens=tokens.ptr, plan_positions=positions.ptr,
                                           plan_num_valid=num_valid.ptr, plan_capacity=self._capacity,
                                           out=out.ptr))
        self._words, self._args = self._params.words, self._params.args
        self._streams = Streams()
        self.device_id = device_id

    def launch(self, slots, tokens, positions, stream: int) -> None:
        w = self._words
        n = slots.shape[0]
        w[_SLOTS], w[_TOKENS], w[_POSITIONS], w[_N] = slots.ptr, tokens.ptr, positions.ptr, n
        w[_WIDE] = sum(bit for bit, v in zip(_WIDE_BITS, (slots, tokens, positions)) if v.dtype.itemsize == 8)
        grid = agree_grid(n, self._capacity, self._resident)
        with OnDevice(self.device_id):  # the module's function belongs to this device's context
            self._fn((grid,), (THREADS,), self._args, stream=self._streams.get_stream(stream))
