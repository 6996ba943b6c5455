"""The cached-prefix sweep (docs/integration.md 5b): verifying KV that no running request reads this step.

A prefix / radix cache keeps the KV of finished requests for later hits; the per-step plan verifies only what
the batch reads, so a stray write into an unreferenced cached block stays hidden until a hit reads it (and
then the request that hit it is already computing on bad KV). The sweep verifies the registered cached
prefixes a few entries per step, through the ordinary verify kernel on a dedicated :class:`VerifyPlan`.

Layout. Each swept group keeps a host rotation of *runs*, one per registered prefix: a ``[4, n]`` int64 block
(slot, expected token, expected position, predecessor slot: the verify plan's four entry arrays, precomputed
once at registration). A step copies at most ``budget`` entries from the rotation into the plan and advances
the cursor; new runs go to the end of the rotation, evicted runs are skipped and compacted away lazily.

Device plan: one ``[1 + 4 B]`` int64 array (``B`` = budget): word 0 holds ``verify_num_valid`` and ``enable``
as two int32, then the four entry arrays back to back, so a full step is a single host-to-device copy from
pinned memory. Nothing else lives on the device: a device-resident table of every cached entry would need a
gather kernel per step and memory proportional to the cache, for a transfer of at most ``32 B + 8`` bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Sequence

import numpy as np

from ..errors import fail
from ..interop.adapter import as_view
from ..interop.cudart import H2D, OnDevice, runtime
from ..interop.hostcopy import to_host
from ..contract.plans import MISSING_SLOT, VerifyPlan
from ..interop.libs import library_of
from .groups import BoundGroup

SLOT, TOKEN, POSITION, PREV = range(4)
_COMPACT_MIN = 64  # dead runs tolerated before the rotation list is rebuilt (amortizes evictions to O(1))


def check_budget(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 0:
        raise fail(ValueError, f"{name}: expected an int >= 0 (0: no sweep), got {value!r}")
    return int(value)


@dataclass(eq=False)
class _Run:
    key: Hashable
    block: np.ndarray  # [4, n] int64, rows SLOT, TOKEN, POSITION, PREV
    dead: bool = False

    @property
    def n(self) -> int:
        return self.block.shape[1]


class GroupSweep:
    """One group's rotation over its registered prefixes, and the dedicated plan it stages into."""

    def __init__(self, group: BoundGroup, budget: int, tag: int, empty):
        self.group = group
        self.budget = budget
        self.tag = tag
        self.block = empty(1 + 4 * budget, np.int64)
        b = self.block
        scalars = b[0:1].view(np.int32) if not _is_torch(b) else b[0:1].view(__import__("torch").int32)
        self.plan = VerifyPlan(
            verify_slot_indices=b[1:1 + budget], verify_expected_tokens=b[1 + budget:1 + 2 * budget],
            verify_expected_positions=b[1 + 2 * budget:1 + 3 * budget], verify_prev_slot_indices=b[1 + 3 * budget:],
            verify_num_valid=scalars[0:1], enable=scalars[1:2], status=None,
        )
        self.runs: dict[Hashable, _Run] = {}
        self.order: list[_Run] = []
        self.index = 0  # cursor: run in self.order ...
        self.offset = 0  # ... and entry within it
        self.dead = 0
        self.total = 0
        self.swept = 0  # entries staged since binding
        self.passes = 0  # times the cursor wrapped around the rotation

    @property
    def name(self) -> str:
        return self.group.name

    def add(self, key: Hashable, block: np.ndarray) -> None:
        run = _Run(key, block)
        self.runs[key] = run
        # The end of the list is the last place this pass visits: entries already pending are not delayed, which
        # is what the documented bound rests on.
        self.order.append(run)
        self.total += run.n

    def remove(self, key: Hashable) -> None:
        run = self.runs.pop(key, None)
        if run is None:
            return
        run.dead = True
        self.total -= run.n
        self.dead += 1
        if self.dead > max(_COMPACT_MIN, len(self.runs)):
            self._compact()

    def _compact(self) -> None:
        live_before = sum(1 for r in self.order[:self.index] if not r.dead)
        if self.index < len(self.order) and self.order[self.index].dead:
            self.offset = 0
        self.order = [r for r in self.order if not r.dead]
        self.index, self.dead = live_before, 0

    def take(self, out: np.ndarray) -> int:
        """Copy the next ``min(budget, total)`` entries of the rotation into ``out`` (``[4, budget]`` int64
        host view); each entry at most once per step."""
        want = min(self.budget, self.total)
        n = 0
        while n < want:
            if self.index >= len(self.order):
                self.index, self.offset = 0, 0
                self.passes += 1
            run = self.order[self.index]
            if run.dead or self.offset >= run.n:
                self.index, self.offset = self.index + 1, 0
                continue
            k = min(run.n - self.offset, want - n)
            out[:, n:n + k] = run.block[:, self.offset:self.offset + k]
            n += k
            self.offset += k
            if self.offset == run.n:
                self.index, self.offset = self.index + 1, 0
        self.swept += n
        return n

    def holders(self, slot: int, position: int) -> list[tuple[Hashable, int]]:
        """Registered prefixes whose entry at ``position`` is ``slot`` (an O(cached entries) scan: error path)."""
        out = []
        for key, run in self.runs.items():
            hit = (run.block[SLOT] == slot) & (run.block[POSITION] == position)
            if hit.any():
                out.append((key, int(position)))
        return out


def _is_torch(array: Any) -> bool:
    return library_of(array) == "torch"


class HostSweepStager:
    """Host arrays: the plan block is a NumPy array, filled in place."""

    def stage(self, sweep: GroupSweep, stream: int) -> int:
        b = sweep.block
        n = sweep.take(b[1:].reshape(4, sweep.budget))
        b[0:1].view(np.int32)[:] = (n, 1)
        return n

    def close(self) -> None:
        pass


class CudaSweepStager:
    """CUDA arrays: a few pinned copies of each group's plan block, filled on the host and copied on the engine's
    stream (an event per copy says when its pinned buffer may be refilled: the only host wait, when the host is
    ``depth`` steps ahead of the GPU)."""

    def __init__(self, ordinal: int, sweeps: Sequence[GroupSweep], depth: int = 3):
        from .transfer import Pinned

        self.ordinal, self.rt = ordinal, runtime()
        with OnDevice(self.rt, ordinal):
            self.bufs = {s.name: [Pinned(8 * (1 + 4 * s.budget)) for _ in range(depth)] for s in sweeps}
        self.next = {s.name: 0 for s in sweeps}
        self.ptrs = {s.name: as_view(s.block, f"{s.name}.sweep_plan").ptr for s in sweeps}

    def stage(self, sweep: GroupSweep, stream: int) -> int:
        rt = self.rt
        ring = self.bufs[sweep.name]
        buf = ring[self.next[sweep.name]]
        self.next[sweep.name] = (self.next[sweep.name] + 1) % len(ring)
        budget = sweep.budget
        with OnDevice(rt, self.ordinal):
            buf.wait()
            host = buf.array(0, (1 + 4 * budget,), np.int64)
            n = sweep.take(host[1:].reshape(4, budget))
            host[0:1].view(np.int32)[:] = (n, 1)
            dst = self.ptrs[sweep.name]
            # A full step is one contiguous copy; a short one copies the scalars and the n used entries per array.
            pieces = [(0, 8 * (1 + 4 * budget))] if n == budget else [(0, 8)] + [
                (8 * (1 + i * budget), 8 * n) for i in range(4) if n]
            for off, nbytes in pieces:
                rt.memcpy_async(dst + off, buf.ptr + off, nbytes, H2D, stream)
            rt.event_record(buf.ev, stream)
            buf.pending = True
        return n

    def close(self) -> None:
        with OnDevice(self.rt, self.ordinal):
            for ring in self.bufs.values():
                for b in ring:
                    b.wait()
                    b.free()


def _ints(value: Any, name: str) -> np.ndarray:
    """A host 1-D int64 copy of ``value`` (a list, NumPy, or any device array: a sync for those)."""
    if isinstance(value, (list, tuple, range)):
        arr = np.asarray(value)
        if arr.size == 0:
            arr = arr.astype(np.int64)
    elif isinstance(value, np.ndarray):
        arr = value
    else:
        try:
            arr = np.asarray(to_host(value))
        except Exception as exc:  # noqa: BLE001 - to_host raises per library; the message names the argument
            raise fail(TypeError, f"{name}: expected a 1-D integer array or sequence, got {type(value).__name__}"
                       ) from exc
    if arr.dtype.kind not in "iu":
        raise fail(TypeError, f"{name}: expected integer values, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise fail(ValueError, f"{name}: expected a 1-D array, got shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


class Sweeper:
    """The manager's sweep: registered prefixes (by key), one :class:`GroupSweep` per swept group, the stager."""

    def __init__(self, groups: Sequence[BoundGroup], default_budget: int, empty, ordinal: int | None,
                 prefix_source: Callable[[], Iterable] | None):
        self.sweeps: dict[str, GroupSweep] = {}
        n_groups = len(groups)
        for g in groups:
            own = g.spec.sweep_budget
            budget = default_budget if own is None else check_budget(f"groups[{g.index}].sweep_budget", own)
            if g.spec.full_to_swa_index_mapping is not None:
                if own:
                    raise fail(ValueError, f"groups[{g.index}].sweep_budget: expected 0 for the sliding-window "
                                           f"group {g.name!r} (the sweep verifies full-pool slots), got {own}")
                continue
            if budget:
                self.sweeps[g.name] = GroupSweep(g, budget, 2 * n_groups + g.index, empty)
        if prefix_source is not None and not callable(prefix_source):
            raise fail(TypeError, f"prefix_source: expected None or a callable returning (key, slots, tokens, "
                                  f"start_position) tuples, got {type(prefix_source).__name__}")
        self.source = prefix_source
        self.keys: dict[Hashable, tuple[str, ...]] = {}  # registered key -> groups sweeping it
        self.stager = (HostSweepStager() if ordinal is None or not self.sweeps
                       else CudaSweepStager(ordinal, list(self.sweeps.values())))

    def __bool__(self) -> bool:
        return bool(self.sweeps)

    # -- registration --------------------------------------------------------------------------------------------
    def cache(self, key: Hashable, slots: Any, tokens: Any, start_position: int, prev_slot: int | None,
              groups: Sequence[str] | None, by_name: dict[str, BoundGroup]) -> None:
        try:
            hash(key)
        except TypeError as exc:
            raise fail(TypeError, f"key: expected a hashable prefix key, got {type(key).__name__}") from exc
        if key in self.keys:
            raise fail(ValueError, f"key: expected a prefix not yet cached, got {key!r} (already cached; call "
                                   f"evict_prefix first)")
        if isinstance(start_position, bool) or not isinstance(start_position, (int, np.integer)) \
                or int(start_position) < 0:
            raise fail(ValueError, f"start_position: expected an int >= 0, got {start_position!r}")
        start = int(start_position)
        s = _ints(slots, "slots")
        n = s.shape[0]
        t = None if tokens is None else _ints(tokens, "tokens")
        if t is not None and t.shape[0] != n:
            raise fail(ValueError, f"tokens: expected one token per slot ({n}), got {t.shape[0]}")
        if prev_slot is None:
            # Position 0 chains from the anchor; a later start's predecessor is another node's: skip that link
            # (verify's "no link": 0, or MISSING_SLOT in a group whose slot 0 is real, SPEC 4).
            first_prev = -1 if start == 0 else None
        else:
            if isinstance(prev_slot, bool) or not isinstance(prev_slot, (int, np.integer)):
                raise fail(TypeError, f"prev_slot: expected None or an int, got {type(prev_slot).__name__}")
            if start == 0 and int(prev_slot) != -1:
                raise fail(ValueError, f"prev_slot: expected None or -1 at start_position 0 (no predecessor), got "
                                       f"{prev_slot}")
            first_prev = int(prev_slot)
        targets = self._targets(groups, by_name)
        for name in targets:
            g = self.sweeps[name].group
            num_slots = int(g.spec.num_slots)
            lowest = 0 if g.spec.padding_slot == -1 else 1  # slot 0 is real there (SPEC 3.2)
            bad = np.flatnonzero((s < lowest) | (s >= num_slots))
            if bad.size:
                i = int(bad[0])
                raise fail(ValueError, f"slots: expected slot ids in [{lowest}, {num_slots}) (group {name!r}'s pool"
                                       f"{'' if lowest == 0 else '; 0 is padding'}), got slots[{i}] = {int(s[i])}")
            if first_prev is not None and not -1 <= first_prev < num_slots:
                raise fail(ValueError, f"prev_slot: expected -1 or a slot id below {num_slots} (group {name!r}), "
                                       f"got {first_prev}")
        for name in targets:
            sweep = self.sweeps[name]
            block = np.empty((4, n), dtype=np.int64)
            block[SLOT] = s
            block[POSITION] = np.arange(start, start + n, dtype=np.int64)
            block[PREV, :1] = first_prev if first_prev is not None else (
                MISSING_SLOT if sweep.group.spec.padding_slot == -1 else 0)
            block[PREV, 1:] = s[:-1]
            block[TOKEN] = -1
            if t is not None:
                # A draft pool's KV at position p was computed with the token at p + offset (groups.py).
                off = int(sweep.group.spec.kv_token_id_vs_position_offset)
                lo, hi = max(0, -off), min(n, n - off)
                if hi > lo:
                    block[TOKEN, lo:hi] = t[lo + off:hi + off]
            sweep.add(key, block)
        self.keys[key] = tuple(targets)

    def _targets(self, groups: Sequence[str] | None, by_name: dict[str, BoundGroup]) -> list[str]:
        if groups is None:
            return list(self.sweeps)
        if isinstance(groups, str):
            groups = [groups]
        out = []
        for name in groups:
            if name not in by_name:
                raise fail(ValueError, f"groups: expected names among {sorted(by_name)}, got {name!r}")
            if name not in self.sweeps:
                raise fail(ValueError, f"groups: expected groups with a sweep (sweep_budget > 0, no sliding "
                                       f"window) among {sorted(self.sweeps)}, got {name!r}")
            out.append(name)
        return out

    def evict(self, key: Hashable) -> None:
        names = self.keys.pop(key, None)
        if names is None:
            raise fail(KeyError, f"key: expected a cached prefix (cache_prefix first), got {key!r}")
        for name in names:
            self.sweeps[name].remove(key)

    def refresh(self, by_name: dict[str, BoundGroup]) -> None:
        """Mirror the engine's ``prefix_source``: new keys are registered, keys it no longer yields evicted
        (a key's slots and tokens are read once: a cached prefix does not change under its key)."""
        if self.source is None:
            return
        seen = set()
        for item in self.source():
            if not isinstance(item, tuple) or not 3 <= len(item) <= 4:
                raise fail(TypeError, f"prefix_source: expected (key, slots, tokens[, start_position]) tuples, got "
                                      f"{type(item).__name__} {item!r:.80}")
            key = item[0]
            seen.add(key)
            if key not in self.keys:
                self.cache(key, item[1], item[2], item[3] if len(item) == 4 else 0, None, None, by_name)
        for key in [k for k in self.keys if k not in seen]:
            self.evict(key)

    # -- per step ------------------------------------------------------------------------------------------------
    def stage(self, names: Iterable[str], stream: int) -> list[GroupSweep]:
        """Stage the next entries of each named group that has a sweep (always, even none: the plan's previous
        entries may name evicted slots). Returns the sweeps to launch."""
        out = []
        for name in names:
            sweep = self.sweeps.get(name)
            if sweep is not None:
                self.stager.stage(sweep, stream)
                out.append(sweep)
        return out

    def holders(self, group: str, slot: int, position: int) -> tuple[tuple[Hashable, int], ...]:
        sweep = self.sweeps.get(group)
        return () if sweep is None else tuple(sweep.holders(slot, position))

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            "cached_entries": {n: s.total for n, s in self.sweeps.items()},
            "swept_entries": {n: s.swept for n, s in self.sweeps.items()},
            "sweep_passes": {n: s.passes for n, s in self.sweeps.items()},
        }

    def close(self) -> None:
        self.stager.close()
