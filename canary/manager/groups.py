"""What a manager binds per KV group: :class:`KVGroup` (the engine's description) and :class:`BoundGroup` (the
plans, state, planner and canary allocated for it)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..errors import check_keywords, fail
from ..interop.adapter import as_view, identity
from ..plan.planner import CanaryPlanner
from ..contract.plans import VerifyPlan, WritePlan, check_padding_slot
from ..records.api import CanaryRecords
from ..contract.realkv import RealKVMode, real_kv
from ..contract.state import CanaryState
from .index import check_index, planner_index
from .layers import bind_layers


@dataclass(kw_only=True)
class KVGroup:
    """One KV pool an engine's attention reads, as the manager binds it.

    - ``name``: unique label used in reports, stats and metrics (``"full"``, ``"swa"``, ``"draft"``...).
    - The index the attention reads, the engine's own arrays read in place, exactly one form (SPEC 3.8):
      ``req_to_token``, ``[max_reqs, max_seq_len]`` int32 (row 0 = padding); or ``block_table``,
      ``[max_reqs, max_blocks]`` int32 or int64 block ids (row 0 = padding, block 0 = the padding block unless
      ``padding_slot=-1``), and ``page_size`` (slot ``b * page_size + p % page_size``); or a page list,
      ``kv_indptr`` (``[>= max_batch_size + 1]``) and ``kv_indices`` (``[nnz]``), int32 or int64, keyed by batch
      row, with ``page_size``, ``max_reqs`` (the
      rows ``req_pool_indices`` names: the sampling cursors') and ``max_seq_len`` (the most tokens a request
      holds: the expected-token pool's columns), which the page list cannot give. An engine that rebuilds its
      block table or page list each step passes them to ``before_forward`` too.
    - ``num_slots``: slots of this group's KV pool (the canary keeps one record per slot; SWA: the SWA pool's).
    - ``verify_capacity``: verify entries per step (a cost budget: steps with more are sampled, SPEC 3.7).
    - ``real_kv_sources``: up to 4 sources as :func:`canary.real_kv` takes them, typically the K and V buffers:
      ``[(k_buffer, page_size, k_bytes_per_token), (v_buffer, page_size, v_bytes_per_token)]``; ``()`` hashes
      no KV bytes. ``real_kv_mode``: ``"all"`` (default), ``"partial"`` or ``"none"``.
    - ``swa_window_size`` / ``full_to_swa_index_mapping``: a sliding-window group (window in tokens, ``[lut_len]``
      int64 full slot -> SWA slot); its writes translate ``out_cache_loc`` through the mapping.
    - ``kv_token_id_vs_position_offset``: 0 for a target model, +1 for an EAGLE draft model's pool.
    - ``padding_rows_carry_tokens``: SPEC 3.2 (False: SGLang's layout).
    - ``padding_slot``: ``0`` (default, SGLang's: slot 0 / block 0 are padding, never verified) or ``-1`` (the
      engine's slot 0 and block 0 are real, a negative slot or block entry marks padding: Hugging Face
      transformers' continuous batching), SPEC 3.2 "No reserved slot"; passed to the group's planner and
      records alike. Row 0 of the index stays the padding row in both.
    - ``sweep_budget``: cached-prefix entries this group verifies per step (docs/integration.md 5b); ``None``
      takes the manager's ``sweep_budget``, 0 turns the sweep off. Sliding-window groups are not swept.
    - ``on_overflow``: ``"sample"`` (default) or ``"skip"``, as for :class:`canary.CanaryPlanner`.
    - ``layer_sources``: the layer rotation (docs/integration.md 5c): one item per layer, each that layer's
      sources as ``real_kv_sources`` takes them (``[[(k[l], page_size, nbytes), (v[l], page_size, nbytes)] for l
      in range(num_layers)]``); every layer with the same layout. ``()``: no rotation.
      ``layer_real_kv_mode``: ``"all"`` (default) or ``"partial"``. ``layer_rotation``: ``None`` (default: on
      when two or more layers are given), ``True`` or ``False``. ``layer_dwell``: steps each layer stays under
      the cursor (1; with sampled verification, the sampling bound K: docs/integration.md 5c).
    """

    name: str
    req_to_token: Any = None  # or one of the paged forms below (exactly one form)
    num_slots: int
    verify_capacity: int
    block_table: Any = None
    kv_indptr: Any = None
    kv_indices: Any = None
    page_size: int | None = None
    max_reqs: int | None = None  # a page list only (SPEC 3.8: its rows are batch rows)
    max_seq_len: int | None = None  # a page list only
    real_kv_sources: Sequence[Any] = ()
    real_kv_mode: Any = RealKVMode.ALL
    swa_window_size: int = 0
    full_to_swa_index_mapping: Any = None
    kv_token_id_vs_position_offset: int = 0
    padding_rows_carry_tokens: bool = False
    padding_slot: int = 0  # SPEC 3.2 "No reserved slot": -1 when the engine's slot 0 is a real slot
    sweep_budget: int | None = None
    on_overflow: str = "sample"  # the planner's (SPEC 3.7): "skip" verifies nothing on a step over the budget
    layer_sources: Sequence[Any] = ()
    layer_real_kv_mode: Any = RealKVMode.ALL
    layer_rotation: bool | None = None
    layer_dwell: int = 1

    @property
    def rotates_layers(self) -> bool:
        """Whether the manager binds the layer rotation for this group."""
        if self.layer_rotation is None:
            return len(self.layer_sources) >= 2
        return bool(self.layer_rotation)

    @property
    def kind(self) -> str:
        if self.swa_window_size > 0:
            return "swa"
        return "draft" if self.kv_token_id_vs_position_offset else "full"


def _worded_init(init):
    """KVGroup's generated ``__init__``, with Python's own argument errors worded as this library's."""
    names = tuple(f.name for f in dataclasses.fields(KVGroup))
    required = tuple(f.name for f in dataclasses.fields(KVGroup)
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_keywords("KVGroup", args, kwargs, names, required)
        init(self, **kwargs)

    __init__.__doc__ = init.__doc__
    return __init__


KVGroup.__init__ = _worded_init(KVGroup.__init__)


def check_groups(groups: Any) -> list[KVGroup]:
    """The groups list, checked: at least one, each a :class:`KVGroup` with one index form (SPEC 3.8), unique
    names, one ``max_seq_len``."""
    if isinstance(groups, KVGroup):
        groups = [groups]
    try:
        groups = list(groups)
    except TypeError:
        raise fail(TypeError, f"groups: expected a KVGroup or a list of KVGroups, got {type(groups).__name__}") from None
    if not groups:
        raise fail(ValueError, "groups: expected at least one KVGroup, got none")
    names, max_cols = set(), set()
    for i, g in enumerate(groups):
        if not isinstance(g, KVGroup):
            raise fail(TypeError, f"groups[{i}]: expected a KVGroup, got {type(g).__name__}")
        if not isinstance(g.name, str) or not g.name:
            raise fail(ValueError, f"groups[{i}].name: expected a non-empty str, got {g.name!r}")
        if g.name in names:
            raise fail(ValueError, f"groups[{i}].name: expected a name unique among the groups, got {g.name!r} twice")
        names.add(g.name)
        for attr in ("num_slots", "verify_capacity"):
            value = getattr(g, attr)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
                raise fail(ValueError, f"groups[{i}].{attr}: expected an int >= 1, got {value!r}")
        if not isinstance(g.layer_sources, (list, tuple)):
            raise fail(TypeError, f"groups[{i}].layer_sources: expected a list of per-layer source lists (one a "
                                  f"layer), got {type(g.layer_sources).__name__}")
        check_padding_slot(g.padding_slot, f"groups[{i}].padding_slot")
        max_cols.add(check_index(g, i)[1])
        _check_covers(g, i)
        _check_lut(g, i)
    if len(max_cols) > 1:
        raise fail(ValueError, f"groups: expected every req_to_token to have the same max_seq_len (the "
                               f"expected-token pool is shared; a block table's max_blocks * page_size), got "
                               f"{sorted(max_cols)}")
    return groups


def _check_lut(g: KVGroup, i: int) -> None:
    """An SWA group's ``full_to_swa_index_mapping`` (``[lut_len]`` int64), refused in the group's words: the
    planner would name the bare argument, and with several groups not whose."""
    lut, window = g.full_to_swa_index_mapping, g.swa_window_size
    name = f"groups[{i}].full_to_swa_index_mapping"
    if lut is None:
        if isinstance(window, (int, np.integer)) and window > 0:
            raise fail(ValueError, f"{name}: expected a [lut_len] int64 array with swa_window_size = {int(window)}, "
                                   f"got None")
        return
    v = as_view(lut, name)
    if np.dtype(v.dtype) != np.dtype(np.int64):
        raise fail(TypeError, f"{name}: expected dtype int64, got {np.dtype(v.dtype).name}")
    if len(v.shape) != 1:
        raise fail(ValueError, f"{name}: expected a [lut_len] int64 array, got shape {tuple(v.shape)}")


def _check_covers(g: KVGroup, i: int) -> None:
    """Every slot of the group has its bytes in each real-KV source (and each layer's), refused in the group's
    words before anything is allocated (the records would name their own buffer, not the group's num_slots)."""
    layers = g.layer_sources if len(g.layer_sources) >= 2 else ()
    for what, sources in [("real_kv_sources", g.real_kv_sources)] + [
            (f"layer_sources[{k}]", srcs) for k, srcs in enumerate(layers)]:
        for j, src in enumerate(real_kv(sources, RealKVMode.ALL).sources if sources else ()):
            if src.num_token_slots < int(g.num_slots):
                raise fail(ValueError, f"groups[{i}].num_slots: expected at most the slots of groups[{i}].{what}[{j}] "
                                       f"(rows * page_size = {src.rows} * {src.page_size} = {src.num_token_slots}), "
                                       f"got {int(g.num_slots)}")


@dataclass
class BoundGroup:
    """A group with everything allocated for it: launch tags ``2 * index`` (verify) and ``2 * index + 1``
    (write) tell its ring rows apart from other groups'."""

    index: int
    spec: KVGroup
    verify_plan: VerifyPlan
    write_plan: WritePlan
    state: CanaryState
    planner: CanaryPlanner
    records: CanaryRecords
    loc_scratch: Any = None  # SWA groups: the step's out_cache_loc translated to SWA slots
    layers: Any = None  # the layer rotation (canary/records/layers.py CanaryLayers), or None
    scheduled: int = field(default=0)  # steps since the last report that listed this group
    verify_launch: Any = None  # records.prepare_verify of verify_plan (manager.warmup), when the backend has one
    bound: tuple = ()  # bound_of(spec) when the planner and records were bound (check_bound compares it)
    # A page list's (request ids, kv_indptr, kv_indices) as the step whose page list is current reads it: set when
    # a step that plans the group opens (steps.py), read by the report's attributions (index.py PageIndex)
    page_rows: tuple | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def verify_tag(self) -> int:
        return 2 * self.index

    @property
    def write_tag(self) -> int:
        return 2 * self.index + 1


def bind_group(index: int, spec: KVGroup, *, pool: Any, device: Any, library: str | None, backend: str,
               max_batch_size: int, ring_capacity: int, max_step_tokens: int, empty,
               report: tuple | None = None, reported_slots: Any = None) -> BoundGroup:
    """Allocate and bind one group (every buffer once; nothing is allocated per step). ``report``: the group's
    ``(ring, ring_write_index, slot_run_counter, kernel_run_counter, status)`` in the manager's
    :class:`~canary.manager.block.ReportBlock` (``None``: allocated here); ``reported_slots``: the group's array of
    :class:`~canary.manager.suppress.ReportedSlots` (``None``: the ring is not filtered)."""
    max_reqs = check_index(spec, index)[0]
    vp = VerifyPlan.allocate(verify_capacity=int(spec.verify_capacity), device=device, library=library,
                             max_reqs=max_reqs)
    wp = WritePlan.allocate(write_req_capacity=max_batch_size, device=device, library=library)
    state = CanaryState.allocate(num_slots=int(spec.num_slots), ring_capacity=1 if report else ring_capacity,
                                 device=device, library=library)
    if report is not None:
        ring, write_index, slots, launches, status = report
        state = CanaryState(canary_buffer=state.canary_buffer, ring=ring, ring_write_index=write_index,
                            slot_run_counter=slots, kernel_run_counter=launches, check_flags=state.check_flags)
        vp = dataclasses.replace(vp, status=status)
    if reported_slots is not None:
        state = dataclasses.replace(state, reported_slots=reported_slots)
    planner = CanaryPlanner(
        verify_plan_out=vp, write_plan_out=wp, **planner_index(spec), swa_window_size=spec.swa_window_size,
        full_to_swa_index_mapping=spec.full_to_swa_index_mapping, req_to_verify_expected_tokens=pool,
        kv_token_id_vs_position_offset=spec.kv_token_id_vs_position_offset,
        padding_rows_carry_tokens=spec.padding_rows_carry_tokens, max_batch_size=max_batch_size, backend=backend,
        on_overflow=spec.on_overflow, padding_slot=spec.padding_slot,
    )
    records = CanaryRecords(state, real_kv(spec.real_kv_sources, spec.real_kv_mode), backend=backend,
                            padding_slot=spec.padding_slot)
    scratch = empty(max_step_tokens, np.int64) if spec.full_to_swa_index_mapping is not None else None
    return BoundGroup(index, spec, vp, wp, state, planner, records, scratch, layers=bind_layers(index, spec, records),
                      bound=bound_of(spec))


# The KVGroup attributes a bound group reads in place: the planner binds the tables (the index in its form, SPEC
# 3.8, and the mapping), the records the sources
TABLE_ATTRS = ("req_to_token", "block_table", "kv_indptr", "kv_indices", "full_to_swa_index_mapping")
BOUND_ATTRS = TABLE_ATTRS + ("real_kv_sources", "layer_sources")


def bound_of(spec: KVGroup) -> tuple:
    """What :func:`check_bound` compares: each bound attribute's object, and for the tables their
    ``(data pointer, shape)`` where :func:`~canary.interop.adapter.identity` reads it cheaply (CuPy, torch)."""
    tables = tuple(getattr(spec, a) for a in TABLE_ATTRS)
    return tables, tuple(identity(t) for t in tables), (spec.real_kv_sources, spec.layer_sources)


def check_bound(groups: list[BoundGroup]) -> None:
    """Raise ``RuntimeError`` naming the buffer and ``rebind`` when a group's KVGroup no longer holds what was
    bound: another object assigned to the attribute, or a table whose storage moved (a torch ``set_`` /
    ``resize_``). Per group and step: seven identity compares and, for the tables given, a pointer read each."""
    for g in groups:
        spec, (tables, idents, sources) = g.spec, g.bound
        if (spec.req_to_token is tables[0] and spec.block_table is tables[1] and spec.kv_indptr is tables[2]
                and spec.kv_indices is tables[3] and spec.full_to_swa_index_mapping is tables[4]
                and spec.real_kv_sources is sources[0] and spec.layer_sources is sources[1]
                and all(t is None or identity(t) == i for t, i in zip(tables, idents))):
            continue
        now = tables + sources
        for k, attr in enumerate(BOUND_ATTRS):
            was = now[k]
            if getattr(spec, attr) is not was:
                what = "another object assigned to it"
            elif k < len(TABLE_ATTRS) and was is not None and identity(was) != idents[k]:
                what = "the same array with its storage moved (data pointer or shape changed)"
            else:
                continue
            raise fail(RuntimeError, f"groups[{g.index}].{attr} (group {g.name!r}): expected the buffer bound at "
                                     f"CanaryManager(...) or the last rebind, got {what}: the manager would read "
                                     f"the old buffer; after rebuilding a bound buffer, call "
                                     f"CanaryManager.rebind({g.name!r}, {attr}=...)")


def rebound(g: BoundGroup, spec: KVGroup, *, pool: Any, max_batch_size: int) -> tuple:
    """``(planner, records, layers)`` of ``g`` bound again over ``spec`` (the group's KVGroup with its rebuilt
    buffers), over the same plans, canary state and expected-token ``pool``: the canary records already written
    stay, and so does the layer-hash table (hashes and cursor) when the group still rotates as many layers (a
    new table's zeros would fail every verified slot's layer check: false ``REAL_KV``). Raises as binding does;
    nothing of ``g`` is changed here."""
    old, new = check_index(g.spec, g.index), check_index(spec, g.index)
    if new != old:
        raise fail(ValueError, f"groups[{g.index}].req_to_token: expected the bound shape {old} (the plans and the "
                               f"expected-token pool are sized by it), got shape {new}")
    _check_covers(spec, g.index)  # a rebuilt, smaller KV pool (or mapping): in the group's words, as at binding
    _check_lut(spec, g.index)
    planner = CanaryPlanner(
        verify_plan_out=g.verify_plan, write_plan_out=g.write_plan, **planner_index(spec),
        swa_window_size=spec.swa_window_size, full_to_swa_index_mapping=spec.full_to_swa_index_mapping,
        req_to_verify_expected_tokens=pool, kv_token_id_vs_position_offset=spec.kv_token_id_vs_position_offset,
        padding_rows_carry_tokens=spec.padding_rows_carry_tokens, max_batch_size=max_batch_size,
        backend=g.planner.backend, on_overflow=spec.on_overflow, padding_slot=spec.padding_slot,
    )
    records = CanaryRecords(g.state, real_kv(spec.real_kv_sources, spec.real_kv_mode), backend=g.records.backend,
                            padding_slot=spec.padding_slot)
    table = None
    if g.layers is not None and spec.rotates_layers and isinstance(spec.layer_sources, (list, tuple)) \
            and len(spec.layer_sources) == g.layers.num_layers:
        table = g.layers.table
    return planner, records, bind_layers(g.index, spec, records, table)
