"""What a backend receives: the checked arguments of each launch (views already validated, SPEC 3.3)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..interop.adapter import ArrayView
from ..contract.kvindex import FORM_PAGES, FORM_TOKENS, NO_REQ_BOUND
from ..contract.plans import VerifyViews, WriteViews
from ..contract.move_layout import row_words
from ..contract.plan_layout import STEP_WIDE
from ..contract.digest_layout import DIGEST_WIDE
from ..contract.records_layout import ENTRY_WIDE, wide_bits


@dataclass(frozen=True)
class LaunchConfig:
    """Launch choices a caller may vary at bind time (tests and benchmarks do; engines keep the defaults).

    - ``fused_max_bs``: the largest batch planned by the one-launch fused kernel (``None``: the kernels' own
      ``FUSED_MAX_BS`` = 512, the most its shared-memory row table holds; a larger value is capped there);
      ``-1`` plans every batch, ``bs = 0`` included, with the two-launch path (rows + entries).
    - ``simulator_threads``: block size of every kernel under Numba's CUDA simulator (``None``: 32, small so
      CI is fast and small cases still span several blocks; ``"gpu"``: the kernels' own GPU block sizes).
      Ignored on a GPU, where the block sizes are the kernels' compile-time constants.
    - ``numba_fast_launch``: the Numba planner launches through ``cuda.core`` with its arguments marshalled at
      bind (``True``) or through numba's own ``kernel[grid, block, stream](...)`` (``False``; also the
      fallback where numba-cuda's internals differ).
    - ``side_blocks``: a sampling planner's two-launch path builds a sampled step's table in side blocks of the
      rows launch, on other SMs while its first block scans the batch (``True``, CuPy), or in that first block
      after its scan (``False``; also what a ``max_batch_size`` past one wave of side blocks gets, since each
      reads every row: more than 134,144 rows on an H200, 131 tiles of 1,024). The outputs are the same; the time
      is not (docs/performance.md). The Numba backend has one way.

    Raises ``TypeError`` / ``ValueError`` (``kv-canary:``) for a value of the wrong type or range.
    """

    fused_max_bs: int | None = None
    simulator_threads: int | str | None = None
    numba_fast_launch: bool = True
    side_blocks: bool = True

    def __post_init__(self):
        from ..errors import fail

        for name in ("fused_max_bs", "simulator_threads"):
            value = getattr(self, name)
            if value is None or (name == "simulator_threads" and value == "gpu"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise fail(TypeError, f"launch_config.{name}: expected an int or None, got {type(value).__name__}")
            low = -1 if name == "fused_max_bs" else 1
            if int(value) < low:
                raise fail(ValueError, f"launch_config.{name}: expected >= {low} or None, got {value}")
        for name in ("numba_fast_launch", "side_blocks"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise fail(TypeError, f"launch_config.{name}: expected a bool, got {type(value).__name__}")


DEFAULT_LAUNCH = LaunchConfig()


@dataclass(frozen=True)
class KVIndex:
    """The checked index of a plan in one of its forms (SPEC 3.8; ``canary/contract/kvindex.py``): ``table`` is
    ``req_to_token`` ``[max_reqs, max_seq_len]`` (``FORM_TOKENS``), ``block_table`` ``[max_reqs, max_blocks]``
    (``FORM_BLOCKS``) or ``kv_indices`` ``[nnz]`` (``FORM_PAGES``, with ``kv_indptr``): int32, or int64 for the
    paged forms (SPEC 2 (*): ``table_wide``)."""

    form: int
    table: ArrayView
    page_size: int = 1
    kv_indptr: ArrayView | None = None  # [>= bs + 1] int32 or int64, FORM_PAGES only

    @property
    def paged(self) -> bool:
        return self.form != FORM_TOKENS

    @property
    def table_wide(self) -> int:
        """1 when the table holds int64 entries (a paged form's block table or kv_indices), else 0."""
        return int(self.table.dtype.itemsize == 8)

    @property
    def rows(self) -> int:
        """Rows of a table keyed by ``req_pool_indices`` (0 for a page list, keyed by batch row)."""
        return 0 if self.form == FORM_PAGES else self.table.shape[0]

    @property
    def row_stride(self) -> int:
        """Elements between the table's rows (a one-row table: its row length; a page list: 0)."""
        t = self.table
        if self.form == FORM_PAGES:
            return 0
        return t.strides[0] if t.shape[0] > 1 else t.shape[1]

    @property
    def max_seq_len(self) -> int:
        """Positions a row may hold: ``req_to_token``'s columns, ``max_blocks * S``, or ``nnz * S`` (no row of a
        page list holds more than all its pages; each row's own bound is its pages, SPEC 3.8)."""
        t = self.table
        if self.form == FORM_PAGES:
            return t.shape[0] * self.page_size
        return t.shape[1] * self.page_size

    @property
    def key_stride(self) -> int:
        """The kernels' virtual token index of position ``p`` of a row with key ``k`` is ``k * key_stride + p``
        (key: ``rp``, or ``kv_indptr[r]`` for a page list); the paged forms read block ``v // S``."""
        if self.form == FORM_PAGES:
            return self.page_size
        return self.row_stride * self.page_size

    @property
    def arrays(self) -> list[ArrayView]:
        return [self.table] + ([self.kv_indptr] if self.kv_indptr is not None else [])


@dataclass(frozen=True)
class StaticArgs:
    """Everything a planner binds once. Views are already checked (SPEC 3.3)."""

    req_to_token: ArrayView | None  # [max_reqs, max_seq_len] int32, row stride >= max_seq_len (None: index.paged)
    full_to_swa_index_mapping: ArrayView | None  # [lut_len] int64
    req_to_verify_expected_tokens: ArrayView | None  # [pool_rows, pool_cols] int32
    swa_window_size: int
    kv_token_id_vs_position_offset: int
    padding_rows_carry_tokens: bool  # SPEC 3.2: padding rows' E counts in write_offsets (their seed: SKIP_SEED)
    verify_slot_indices: ArrayView  # [C] int64
    verify_expected_tokens: ArrayView
    verify_expected_positions: ArrayView
    verify_prev_slot_indices: ArrayView
    verify_num_valid: ArrayView  # [1] int32
    enable: ArrayView
    status: ArrayView
    write_offsets: ArrayView  # [R+1] int64
    write_seed_slot_indices: ArrayView  # [R] int64
    write_num_valid_reqs: ArrayView  # [1] int32
    verify_capacity: int
    write_req_capacity: int
    max_batch_size: int
    # SPEC 3.7: [max_reqs] int64 rotation state of the sampled verification; None when on_overflow="skip"
    verify_cursors: ArrayView | None
    device_id: int  # -1 for host
    # The outputs' byte ranges (overlap.Spans: addresses and names, no arrays): per-step inputs are checked
    # against them when first seen.
    output_spans: Any = None
    padding_slot: int = 0  # SPEC 3.2 "No reserved slot": 0 (slot 0 is padding) or -1 (a negative slot is)
    # The bound index (SPEC 3.8); None: req_to_token's (KVIndex(FORM_TOKENS, req_to_token))
    kv_index: KVIndex | None = None

    @property
    def index(self) -> KVIndex:
        return self.kv_index if self.kv_index is not None else KVIndex(FORM_TOKENS, self.req_to_token)

    @property
    def sample(self) -> bool:
        """Whether a step over the capacity verifies a rotating sample (``on_overflow="sample"``)."""
        return self.verify_cursors is not None

    @property
    def max_reqs(self) -> int:
        """The bound of ``req_pool_indices``: the rows of ``req_to_token`` or of the block table; for a page list
        (keyed by batch row) the sampling cursors' rows, else no bound (SPEC 3.8)."""
        index = self.index
        if index.form != FORM_PAGES:
            return index.rows
        return self.verify_cursors.shape[0] if self.verify_cursors is not None else NO_REQ_BOUND

    @property
    def cursor_rows(self) -> int:
        """Rows of ``verify_cursors`` (0 without sampling): the scratch's next cursors (CuPy) have one a row."""
        return 0 if self.verify_cursors is None else self.verify_cursors.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.index.max_seq_len

    @property
    def req_pool_index_bound(self) -> int:
        """Exclusive upper bound of a valid ``req_pool_indices`` value (SPEC 3.4 bit 2) when the pool is keyed
        by ``req_pool_indices`` (no ``expected_token_pool_indices``)."""
        pool = self.req_to_verify_expected_tokens
        return self.max_reqs if pool is None else min(self.max_reqs, pool.shape[0])

    @property
    def pool_rows(self) -> int:
        pool = self.req_to_verify_expected_tokens
        return 0 if pool is None else pool.shape[0]


@dataclass(frozen=True)
class StepArgs:
    """The per-step inputs, ``[bs]`` int32 or int64 each (``valid_lens`` present iff an expected-token pool is bound;
    ``pool_indices``, the optional ``expected_token_pool_indices``, only with a pool), and the step's own index
    arrays when it passed them (``index``, of the bound form)."""

    req_pool_indices: ArrayView
    prefix_lens: ArrayView
    extend_seq_lens: ArrayView
    valid_lens: ArrayView | None
    bs: int
    pool_indices: ArrayView | None = None
    index: KVIndex | None = None  # this step's index (SPEC 3.8: an engine that rebuilds it); None: the bound one

    @property
    def step_wide(self) -> int:
        """PlanParams.step_wide: a bit (plan_layout.STEP_WIDE) for each step array that holds int64."""
        return wide_bits(STEP_WIDE, dict(
            req_pool_indices=self.req_pool_indices, prefix_lens=self.prefix_lens,
            extend_seq_lens=self.extend_seq_lens, valid_lens=self.valid_lens,
            expected_token_pool_indices=self.pool_indices))


@dataclass(frozen=True)
class RecordWriteArgs:
    """One write launch's inputs, checked (docs/records.md 4): the write plan's views, ``[N]`` int32 or int64
    entry arrays (the expected ones ``None`` when not given), the launch tag."""

    plan: WriteViews
    out_cache_loc: ArrayView
    input_ids: ArrayView
    positions: ArrayView
    expected_input_ids: ArrayView | None
    expected_positions: ArrayView | None
    launch_tag: int

    @property
    def entry_wide(self) -> int:
        """WriteParams.entry_wide: a bit (records_layout.ENTRY_WIDE) for each entry array that holds int64."""
        return wide_bits(ENTRY_WIDE, dict(
            out_cache_loc=self.out_cache_loc, input_ids=self.input_ids, positions=self.positions,
            expected_input_ids=self.expected_input_ids, expected_positions=self.expected_positions))


@dataclass(frozen=True)
class RecordVerifyArgs:
    """One verify launch's inputs, checked (docs/records.md 5): the verify plan's views (its ``status`` is not
    read), the launch tag."""

    plan: VerifyViews
    launch_tag: int


@dataclass(frozen=True)
class ScatterArgs:
    """One expected-token scatter's inputs, checked (docs/records.md 7)."""

    pool: ArrayView  # [pool_rows, pool_cols] int32, written
    req_pool_indices: ArrayView  # [bs] int64
    tokens: ArrayView  # [N] int64 or int32
    token_offsets: ArrayView  # [>= bs + 1] int64
    column_starts: ArrayView  # [bs] int64
    column_offset: int

    @property
    def pool_row_stride(self) -> int:
        """Elements between pool rows (a one-row pool has no stride of its own: the row length)."""
        return self.pool.strides[0] if self.pool.shape[0] > 1 else self.pool.shape[1]


@dataclass(frozen=True)
class MoveTables:
    """What a mover moves (SPEC 4.1), checked at bind: the records' ``canary_buffer`` (``num_slots`` slots,
    ``slot_stride_bytes`` apart; ``fields`` its host ``[num_slots, 4]`` int64 view on the host), the optional layer
    table ``layer_hashes`` ``[num_slots, num_layers]`` int64 (``None``: ``num_layers = 0``) and the status word
    ``[2]`` int64, all on ``device_id``."""

    canary_buffer: ArrayView
    num_slots: int
    slot_stride_bytes: int
    fields: Any  # np.ndarray [num_slots, 4] int64 on the host, else None
    layer_hashes: ArrayView | None
    num_layers: int
    status: ArrayView
    device_id: int

    @property
    def row_words(self) -> int:
        return row_words(self.num_layers)


@dataclass(frozen=True)
class MoveArgs:
    """One gather or scatter launch, checked: the slot list ``[n]`` int32 or int64 and the buffer ``rows``
    ``[>= n, row_words]`` int64 (written by a gather, read by a scatter)."""

    slots: ArrayView
    rows: ArrayView

    @property
    def slots_wide(self) -> int:
        return int(self.slots.dtype.itemsize == 8)

    @property
    def row_stride(self) -> int:
        """Elements between buffer rows (a one-row buffer has no stride of its own: the row length)."""
        return self.rows.strides[0] if self.rows.shape[0] > 1 else self.rows.shape[1]


@dataclass(frozen=True)
class DigestArgs:
    """One block-digest launch's inputs, checked (SPEC 4.2): the block arrays (int32 or int64 each; ``block_lens``
    ``None`` when not given) and the outputs: ``out`` (and ``status``, optional) for ``compute``, ``expected``,
    ``mismatch`` and ``count`` for ``check`` (the other call's are ``None``)."""

    kv_indptr: ArrayView  # [>= nb + 1]
    kv_indices: ArrayView  # [nnz] page ids
    block_positions: ArrayView  # [nb]
    block_lens: ArrayView | None  # [nb]
    out: ArrayView | None = None  # compute: [nb] int64 or uint64
    status: ArrayView | None = None  # compute: [nb] uint8, optional
    expected: ArrayView | None = None  # check: [nb] int64 or uint64
    mismatch: ArrayView | None = None  # check: [nb] uint8
    count: ArrayView | None = None  # check: [1] int32 or int64

    @property
    def num_blocks(self) -> int:
        return self.block_positions.shape[0]

    @property
    def index_wide(self) -> int:
        """DigestParams.index_wide: a bit (digest_layout.DIGEST_WIDE) for each array that holds int64."""
        return wide_bits(DIGEST_WIDE, dict(kv_indptr=self.kv_indptr, kv_indices=self.kv_indices,
                                           block_positions=self.block_positions, block_lens=self.block_lens,
                                           count_out=self.count))
