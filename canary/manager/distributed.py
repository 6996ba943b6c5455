"""A manager per rank (SPEC 4.3, docs/integration.md "Distributed"): its identity, its Prometheus labels, and
the agreement of tensor-parallel ranks and pipeline stages on each decoded step.

:class:`Ranks` names the rank (``tp_rank`` / ``pp_rank`` / ``dp_rank`` and their sizes); its labels go on every
:class:`~canary.manager.report.SlotViolation` (``ranks``, its log line), the stats (``stats()["ranks"]``) and
the Prometheus metrics. :class:`Agreement` runs where the decoder reads a step's report on the host: a fixed-size
summary per KV group, one MAX all-reduce per scope (``"tp"``, ``"pp"``) over the scope's
:class:`~canary.interop.collectives.Communicator`, and, only when some rank saw a violation or the summaries
differ, one SUM all-reduce that gathers every rank's summary to name the ranks: :class:`RankViolation` records,
reported on every rank of the scope in the same report. Data-parallel ranks agree on nothing (per-rank health
and statistics, labelled).

The ``plan`` and ``entries`` words: :func:`plan_digest` / :func:`entries_digest` on the host (a host manager's
NumPy arrays, at ``after_kv_store``); on a GPU manager :class:`DeviceDigests` adds the same bits on the device
(``kernels/agree.cu`` or its Numba twin, after each group's write, on the step's stream: inside its graphs too)
into the group's two words of the report block, which the decoder reads with the rest of the report.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .. import backends
from ..contract.agree_layout import BATCH_SALT as _BATCH_SALT
from ..contract.agree_layout import ENTRY_SALT as _ENTRY_SALT
from ..contract.agree_layout import MASK63 as _MASK63
from ..contract.agree_layout import PLAN_SALT as _PLAN_SALT
from ..contract.hashes import as_u64, mix3_u64
from ..contract.ring import FailReason, KernelTag
from ..errors import fail
from ..interop.adapter import INT_WIDTHS, as_view, check_view
from ..interop.callviews import CallViews
from ..interop.collectives import Communicator
from .report import SlotViolation

FIELDS = ("written", "verified", "status", "batch", "plan", "entries")  # a group's summary words, after its flag
SCOPE_FIELDS = {"tp": FIELDS, "pp": ("verified", "status", "batch", "plan")}  # what each scope compares
# The words are kept non-negative (_MASK63), so that -words carries the MIN through a MAX
_WRITE, _VERIFY = KernelTag.WRITE.counter_index, KernelTag.VERIFY.counter_index  # in a group's slot counters


@dataclass(frozen=True)
class Ranks:
    """This manager's place in the engine: ``tp_rank`` of ``tp_size`` tensor-parallel ranks, ``pp_rank`` of
    ``pp_size`` pipeline stages, ``dp_rank`` of ``dp_size`` data-parallel replicas (ints, ``0 <= rank < size``;
    ``ValueError`` otherwise)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self):
        for axis in ("tp", "pp", "dp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            for name, v, low in ((f"{axis}_size", size, 1), (f"{axis}_rank", rank, 0)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < low:
                    raise fail(ValueError, f"ranks: expected {name} an int >= {low}, got {v!r}")
            if rank >= size:
                raise fail(ValueError, f"ranks: expected {axis}_rank < {axis}_size = {size}, got {rank}")

    def labels(self) -> dict[str, str]:
        """``{"tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}``: the Prometheus labels."""
        return {"tp_rank": str(self.tp_rank), "pp_rank": str(self.pp_rank), "dp_rank": str(self.dp_rank)}

    def suffix(self) -> str:
        """`` tp_rank=0 pp_rank=0 dp_rank=0``: what a log line ends with."""
        return "".join(f" {k}={v}" for k, v in self.labels().items())


@dataclass
class RankViolation(SlotViolation):
    """A violation of the agreement (SPEC 4.3), a :class:`SlotViolation` of ``kernel == "rank"`` (no slot:
    ``slot == position == -1``; ``requests`` empty) reported on every rank of ``scope`` in the same report.

    - ``reason``: ``"RANK_VIOLATION"`` (some rank of the scope found violations in ``group`` at ``first_step``)
      or ``"RANK_DIVERGE"`` (the ranks' summaries of that step differ); ``reason_names`` is ``(reason,)``.
    - ``scope``: ``"tp"`` or ``"pp"``; ``peers``: the ranks named, in the scope's numbering (``tp_rank`` /
      ``pp_rank``): those that saw violations, or those whose summary differs from the one most ranks hold
      (ties: the one of the lowest rank).
    - ``fields``: the summary words that differ (``FIELDS``); ``values``: ``{field: (rank 0's, rank 1's, ...)}``
      for those (RANK_VIOLATION: ``{"violations": per-rank new violations + dropped ring rows}``).
    """

    reason: str = "RANK_VIOLATION"
    scope: str = "tp"
    peers: tuple[int, ...] = ()
    fields: tuple[str, ...] = ()
    values: dict = dataclasses.field(default_factory=dict)

    @property
    def reason_names(self) -> tuple[str, ...]:
        return (self.reason,)

    def line(self) -> str:
        vals = ";".join(f"{k}:{','.join(str(x) for x in v)}" for k, v in self.values.items())
        fields = f" fields={','.join(self.fields)}" if self.fields else ""
        return (f"kv-canary: rank violation group={self.group} step={self.first_step} scope={self.scope} "
                f"ranks={','.join(str(r) for r in self.peers) or '-'} reasons={self.reason}{fields} values={vals}"
                + (self.ranks.suffix() if self.ranks is not None else ""))


def check_distributed(ranks: Any, communicator: Any) -> tuple[Ranks | None, dict[str, Communicator]]:
    """The manager's ``ranks`` and ``communicator`` arguments, checked: ``(Ranks or None, {scope: communicator})``.
    ``communicator``: ``None``, a :class:`Communicator` (the tensor-parallel group) or ``{"tp": c, "pp": c}``
    (either may be left out). Without ``ranks`` they are read from the communicators (``dp`` 0 of 1)."""
    if ranks is not None and not isinstance(ranks, Ranks):
        raise fail(TypeError, f"ranks: expected None or a canary.Ranks, got {type(ranks).__name__}")
    if communicator is None:
        return ranks, {}
    comms = dict(communicator) if isinstance(communicator, Mapping) else {"tp": communicator}
    for scope, c in comms.items():
        if scope not in SCOPE_FIELDS:
            raise fail(ValueError, f"communicator: expected scopes 'tp' and 'pp', got {scope!r}")
        if not isinstance(c, Communicator):
            raise fail(TypeError, f"communicator[{scope!r}]: expected an object with rank, size and "
                                  f"all_reduce(words, op) (canary.interop.collectives), got {type(c).__name__}")
    if ranks is None:
        kw = {f"{s}_{k}": int(getattr(c, k)) for s, c in comms.items() for k in ("rank", "size")}
        ranks = Ranks(**kw)
    for scope, c in comms.items():
        want = (getattr(ranks, f"{scope}_rank"), getattr(ranks, f"{scope}_size"))
        if (int(c.rank), int(c.size)) != want:
            raise fail(ValueError, f"communicator[{scope!r}]: expected rank {want[0]} of {want[1]} (ranks), got "
                                   f"rank {c.rank} of {c.size}")
    return ranks, comms


class _Bound:
    """A ``prometheus_client`` metric whose rank labels are always given (``labels(**kw)`` adds them)."""

    def __init__(self, metric: Any, labels: dict[str, str], own: bool):
        self._metric, self._labels = metric, labels
        self._child = None if own else metric.labels(**labels)

    def labels(self, **kw):
        return self._metric.labels(**kw, **self._labels)

    def __getattr__(self, name: str):  # inc / set of a metric without labels of its own
        return getattr(self._child, name)


class RankedMetrics:
    """``prometheus_client`` as :class:`~canary.manager.stats.PrometheusMetrics` builds its metrics, every
    metric with the rank labels too (``tp_rank``, ``pp_rank``, ``dp_rank``)."""

    def __init__(self, pc: Any, ranks: Ranks):
        self._pc, self._labels = pc, ranks.labels()

    def _make(self, kind: str, name: str, doc: str, labelnames=(), **kw):
        metric = getattr(self._pc, kind)(name, doc, [*labelnames, *self._labels], **kw)
        return _Bound(metric, self._labels, bool(labelnames))

    def Counter(self, *a, **kw):  # noqa: N802 - prometheus_client's names
        return self._make("Counter", *a, **kw)

    def Gauge(self, *a, **kw):  # noqa: N802
        return self._make("Gauge", *a, **kw)


def entries_digest(loc: Any, tok: Any, pos: Any, salt: int = _ENTRY_SALT) -> int | None:
    """The order-independent digest of a step's entries, ``sum(mix3(slot, token, position ^ salt))`` mod 2^64
    over the entries with ``slot >= 0``, its top bit dropped; ``None`` unless all three are NumPy arrays (a GPU
    manager's words come from the device: :class:`DeviceDigests`, the same bits). The reference of both."""
    if not (type(loc) is np.ndarray and type(tok) is np.ndarray and type(pos) is np.ndarray):
        return None
    keep = loc >= 0
    h = mix3_u64(loc[keep], tok[keep], as_u64(pos[keep]) ^ np.uint64(salt))
    return int(h.sum(dtype=np.uint64)) & _MASK63


def plan_digest(vp: Any) -> int | None:
    """The digest of a verify plan's valid entries ``(slot, expected token, expected position)`` (as
    :func:`entries_digest`, another salt; a ``MISSING_SLOT`` entry counts too); ``None`` unless host arrays."""
    n = vp.verify_num_valid
    if type(n) is not np.ndarray:
        return None
    n = max(0, min(int(n[0]), vp.verify_slot_indices.shape[0]))
    slots = vp.verify_slot_indices[:n]
    return entries_digest(as_u64(slots).view(np.int64) & _MASK63, vp.verify_expected_tokens[:n],
                          vp.verify_expected_positions[:n], _PLAN_SALT)


def batch_digest(rpi: np.ndarray | None) -> int:
    """The step's batch as the report brings it back: ``sum(mix3(row, req_pool_index, bs ^ salt))`` mod 2^64."""
    if rpi is None:
        return 0
    rows = np.arange(rpi.shape[0], dtype=np.uint64)
    h = mix3_u64(rows, rpi, np.uint64(rpi.shape[0] ^ _BATCH_SALT))
    return int(h.sum(dtype=np.uint64)) & _MASK63


class Agreement:
    """The per-step agreement of ``groups`` (their names, in order) over ``comms`` (``{scope: communicator}``,
    ``"tp"`` first), read from the report block ``block``. ``lag``: reports kept undecoded behind the newest
    (``1``: none, a host manager's; a GPU manager's ``2`` decodes step ``n - 2`` at the boundary of step ``n``,
    waiting for it if it has not reached the host, so that every rank decodes, and so reduces, the same steps at
    the same calls). ``ranks``: this rank's :class:`Ranks`."""

    def __init__(self, groups: list[str], block: Any, comms: dict[str, Communicator], ranks: Ranks, lag: int):
        self.names, self.block, self.ranks, self.lag = list(groups), block, ranks, int(lag)
        self.device = bool(block.agree_words)  # plan and entries words in the report (DeviceDigests adds them)
        self.comms = [(s, comms[s]) for s in ("tp", "pp") if s in comms]
        g = len(self.names)
        self._last = np.zeros((g, 2), np.int64)  # each group's cumulative (written, verified) counters
        self.entries: dict[int, dict[str, tuple]] = {}  # step -> {group: (plan, entries) digests} (host arrays)
        self.steps = self.gathers = self.bytes = 0

    def stats(self) -> dict[str, Any]:
        """``agreed_steps``, ``gathers`` (the rare path's all-gathers), ``bytes_reduced`` (this rank's words
        all-reduced, all scopes, times 8)."""
        return {"agreed_steps": self.steps, "gathers": self.gathers, "bytes_reduced": self.bytes}

    def note(self, step: int, groups: Any, loc: Any, tok: Any, pos: Any, by_group: dict | None) -> None:
        """After a step's writes (the manager's ``after_kv_store``, its plans still in place): the digests of
        each group's verify plan and written entries, where host arrays (a GPU manager's are in its report)."""
        if self.device:
            return
        got = {}
        for g in groups:
            d = entries_digest((by_group or {}).get(g.name, loc), tok, pos)
            p = plan_digest(g.verify_plan)
            if d is not None or p is not None:
                got[g.name] = (p or 0, d or 0)
        if got:
            self.entries[step] = got
            if len(self.entries) > 64:  # steps never decoded (a manager closed without flush): keep a bound
                self.entries.pop(next(iter(self.entries)))

    def summary(self, rec, words: np.ndarray, rpi: np.ndarray | None, found: list) -> np.ndarray:
        """``[G, 1 + len(FIELDS)]`` int64: per group the flag (new violations + ring rows dropped) and FIELDS."""
        block, g = self.block, len(self.names)
        out = np.zeros((g, 1 + len(FIELDS)), np.int64)
        new = Counter(v.group for v in found if not isinstance(v, RankViolation))
        entries = self.entries.pop(rec.index, {})
        batch = batch_digest(rpi)
        for i, name in enumerate(self.names):
            head = block.heads[i]
            counters = words[[head + _WRITE, head + _VERIFY]]
            written, verified = (counters - self._last[i]).tolist()
            self._last[i] = counters
            index = int(words[i]) & 0xFFFFFFFF
            dropped = max(0, index - block.ring_capacity)
            planned = name in rec.groups
            if self.device:  # the step's sums, added on the device (0: the group was not written)
                w = block.agree_words[i]
                digests = (int(words[w]) & _MASK63, int(words[w + 1]) & _MASK63)
            else:
                digests = entries.get(name, (0, 0))
            out[i] = (new[name] + dropped, written & _MASK63, verified & _MASK63,
                      (int(words[head + 4]) & 0xFFFFFFFF) if planned else 0, batch if planned else 0, *digests)
        return out

    def agree(self, rec, words: np.ndarray, rpi: np.ndarray | None, found: list) -> list:
        """The step's summary reduced over every scope: ``found`` plus the :class:`RankViolation` records (the same
        on every rank of a scope). Every rank calls it for the same steps, in the same order."""
        own = self.summary(rec, words, rpi, found)
        out = list(found)
        self.steps += 1
        for scope, comm in self.comms:
            mine = own.copy()
            cols = [1 + FIELDS.index(f) for f in SCOPE_FIELDS[scope]]
            mine[:, [c for c in range(1, mine.shape[1]) if c not in cols]] = 0  # not compared in this scope
            w = mine[:, 1:].reshape(-1)
            got = comm.all_reduce(np.concatenate([mine[:, 0], w, -w]), "max")
            self.bytes += 8 * got.shape[0]
            g = own.shape[0]
            flags, hi, lo = got[:g], got[g:g + w.shape[0]], -got[g + w.shape[0]:]
            if not flags.any() and (hi == lo).all():
                own[:, 0] = flags  # the next scope carries this one's flags (a stage names its peers' too)
                continue
            table = np.zeros((comm.size, mine.size), np.int64)
            table[comm.rank] = mine.reshape(-1)
            every = comm.all_reduce(table.reshape(-1), "sum").reshape(comm.size, g, -1)
            self.gathers += 1
            self.bytes += 8 * table.size
            out += self.records(rec.index, scope, every, cols)
            own[:, 0] = flags
        return out

    def records(self, step: int, scope: str, every: np.ndarray, cols: list[int]) -> list[RankViolation]:
        """The RankViolation records of one scope from every rank's summary ``every`` (``[size, G, 1 + W]``)."""
        out = []
        for i, name in enumerate(self.names):
            flags = every[:, i, 0]
            if flags.any():
                out.append(self._record(name, step, scope, "RANK_VIOLATION", tuple(np.flatnonzero(flags).tolist()),
                                        (), {"violations": tuple(flags.tolist())}))
            rows = [tuple(every[r, i, cols].tolist()) for r in range(every.shape[0])]
            if len(set(rows)) > 1:
                counts = Counter(rows)
                ref = max(rows, key=lambda r: (counts[r], -rows.index(r)))
                names = SCOPE_FIELDS[scope]
                differ = tuple(f for k, f in enumerate(names) if len({r[k] for r in rows}) > 1)
                values = {f: tuple(r[names.index(f)] for r in rows) for f in differ}
                peers = tuple(r for r, row in enumerate(rows) if row != ref)
                out.append(self._record(name, step, scope, "RANK_DIVERGE", peers, differ, values))
        return out

    def _record(self, group, step, scope, reason, peers, fields, values) -> RankViolation:
        return RankViolation(group=group, kernel="rank", slot=-1, position=-1, reasons=FailReason.NONE, requests=(),
                             first_step=step, last_step=step, count=1, stored_token=-1, expected_token=-1, raw=None,
                             steps=[step], ranks=self.ranks, reason=reason, scope=scope, peers=peers, fields=fields,
                             values=values)


class DeviceDigests:
    """A GPU manager's ``plan`` and ``entries`` words (SPEC 4.3): per group a launcher of the backend's ``agree``
    family (``module``: ``kernels/agree.cu`` through CuPy, or its Numba twin) over the group's verify plan and its
    two words of ``block``. Called from the step's writes (:meth:`~canary.manager.steps.Steps.write`), after every
    group's write: one launch per written group on the write's stream, graph-capturable (a replayed graph holds
    it). ``device_id``, ``owner``: the manager's device and one of its arrays (whose library orders the views)."""

    def __init__(self, module: Any, groups: list, block: Any, device_id: int, owner: Any):
        self.device_id, self.owner, self._cache = device_id, owner, {}
        self.launchers = {}
        for i, g in enumerate(groups):
            vp = g.verify_plan
            plan = tuple(as_view(getattr(vp, f), f) for f in ("verify_slot_indices", "verify_expected_tokens",
                                                              "verify_expected_positions", "verify_num_valid"))
            self.launchers[g.name] = module.AgreeLaunch(device_id, plan=plan, out=as_view(block.agree_out[i],
                                                                                           "agree_words"))

    def __call__(self, sel, loc: Any, tok: Any, pos: Any, by_group: dict | None, st: Any) -> None:
        """Launch each group of ``sel``'s digests of the step's ``loc`` (``by_group[name]`` where given: the slots
        the host formula reads, an SWA group's untranslated ones otherwise), ``tok``, ``pos`` on ``st``."""
        go = CallViews(self.device_id, st, self.owner, cache=self._cache)
        tv, pv = (check_view(go.view(a, n), dtype=INT_WIDTHS, ndim=1) for a, n in ((tok, "input_ids"),
                                                                                  (pos, "positions")))
        for g in sel:
            own = by_group.get(g.name) if by_group else None
            name = "out_cache_loc" if own is None else f"out_cache_loc_by_group[{g.name!r}]"
            lv = check_view(go.view(loc if own is None else own, name), dtype=INT_WIDTHS, ndim=1)
            if not lv.shape[0] == tv.shape[0] == pv.shape[0]:  # the kernel reads n of each (the write refused it)
                raise fail(ValueError, f"{name}, input_ids, positions: expected one length, got {lv.shape[0]}, "
                                       f"{tv.shape[0]}, {pv.shape[0]}")
            self.launchers[g.name].launch(lv, tv, pv, go.handle)


class DistributedManager:
    """The :class:`~canary.CanaryManager` mixin of its ``ranks`` / ``communicator`` arguments."""

    ranks: Ranks | None = None
    _agreement: Agreement | None = None

    def _bind_ranks(self, ranks: Ranks | None, comms: dict[str, Communicator], block: Any) -> None:
        self.ranks = self._decoder.ranks = ranks
        self._decoder.suffix = "" if ranks is None else ranks.suffix()
        if block.agree_words:  # a GPU manager with a communicator: the digests on the device
            module = backends.optional(self.backend, "agree")
            if module is None:
                raise fail(ValueError, f"communicator: expected a backend with the agreement kernel (cupy or "
                                       f"numba) on a CUDA manager, got {self.backend!r}")
            self._steps.agree = DeviceDigests(module, self.groups, block, self.ordinal, self.pool_array)
        if comms:
            lag = 1 if self.ordinal is None else 2
            self._agreement = self._decoder.agreement = Agreement([g.name for g in self.groups], block, comms,
                                                                  ranks, lag)

    def _note_entries(self, sel, loc: Any, tok: Any, pos: Any, by_group: dict | None) -> None:
        # The step's written entries, digested on the host where the engine passed host arrays (no sync)
        if self._agreement is not None and self._steps.step is not None:
            self._agreement.note(self._steps.step.index, sel, loc, tok, pos, by_group)
