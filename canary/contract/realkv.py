"""Real-KV sources: which bytes of the caller's KV cache a canary slot hashes, and the reference fold (SPEC 4).

A **source** is one caller array (any dtype, any library: NumPy, torch, CuPy, JAX...) viewed zero-copy as
``[rows, row_bytes]`` bytes: the first axis is the row axis, all other axes must be contiguous and make up
the row. ``page_size`` tokens share a row, ``num_bytes_per_token`` bytes each: slot ``s`` lives in row
``s // page_size`` at byte offset ``(s % page_size) * num_bytes_per_token``, and its hash reads ``read_bytes``
bytes from there (mode ``ALL``) or the first 16 (mode ``PARTIAL``). Typical layouts:

- SGLang token-major pool ``[num_slots, heads, head_dim]`` bf16: ``page_size=1``,
  ``num_bytes_per_token = heads * head_dim * 2``.
- Paged pool ``[num_pages, page_size, heads, head_dim]``: ``page_size`` as in the engine.

Up to four sources (e.g. K and V of one layer, or one layer of two groups) form a :class:`RealKV`, with one
:class:`RealKVMode` for all of them. Host checks (raised before any launch, ``kv-canary:`` messages naming the
argument, expected and actual values): byte counts positive multiples of 16, ``read_bytes <=
num_bytes_per_token``, ``page_size * num_bytes_per_token <= row_bytes``, rows 16-byte aligned (base pointer
and row stride: the GPU twins use 16-byte loads), at most 4 sources, one device; and, once the canary size is
known, :meth:`RealKV.check_covers` (every canary slot has its bytes: ``rows * page_size >= num_slots``).

The fold (executable form of SPEC 4, vectorized over slots, one loop step per 8-byte word):

- per source: ``acc = 0``; for each little-endian u64 word ``w`` of the slot's bytes in order,
  ``acc = splitmix64(acc ^ w)``;
- combined: ``acc = 0``; for each source in order, ``acc = splitmix64(acc ^ source_hash)``; then
  ``real_kv_hash = acc | 1``;
- mode ``NONE``: the hash is 0 and nothing is read.

Why ``| 1`` (a format change: an even hash stored before it fails REAL_KV after it): ``splitmix64(0) == 0`` and both
accumulators start from 0, so all-zero KV bytes used to fold to 0, which is also the ``real_kv_hash`` of a
never-written (zeroed) record; a prefix-cache hit on a block whose KV store never ran, with its KV still zero,
then passed the REAL_KV check. Forcing the lowest bit makes every fold in modes PARTIAL and ALL odd, hence never
0, whatever the bytes (all-zero bytes fold to exactly 1). The cost is that bit: a changed slot escapes REAL_KV
when its new 63-bit hash collides with the old one (2**-63 for random damage instead of 2**-64), and one OR per
slot on the GPU.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import fail
from ..interop.adapter import HOST, ArrayView, as_view, check_layout
from ..interop.memview import host_view
from .hashes import splitmix64_into

MAX_SOURCES = 4
BYTE_QUANTUM = 16  # every byte count is a positive multiple of this (one 16-byte vector load on the GPU)
PARTIAL_BYTES = 16  # mode PARTIAL reads this many leading bytes of each token
_FOLD_CHUNK_SLOTS = 1 << 16  # slots folded at a time: bounds the gathered words (a few MiB)


class RealKVMode(enum.IntEnum):
    """How much of each token's real KV bytes the canary hashes (one mode for all sources)."""

    NONE = 0  # no reads; real_kv_hash = 0 and verify skips the real-KV comparison
    PARTIAL = 1  # the first 16 bytes of each token in each source
    ALL = 2  # read_bytes bytes of each token in each source

    @classmethod
    def coerce(cls, value: Any) -> RealKVMode:
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            try:
                return cls(int(value))
            except ValueError:
                pass
        raise fail(ValueError, f"real_kv_mode: expected one of NONE, PARTIAL, ALL, got {value!r}")


@dataclass(frozen=True)
class RealKVSource:
    """One validated source. ``bytes`` is the zero-copy ``[rows, row_bytes]`` uint8 NumPy view (host only).

    ``ptr``, ``rows``, ``row_stride_bytes``, ``device_id`` describe the memory for the GPU twins; ``owner`` keeps
    the caller's array alive.
    """

    name: str
    ptr: int
    rows: int
    row_bytes: int
    row_stride_bytes: int
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    device_id: int
    owner: Any
    bytes: np.ndarray | None
    words_view: np.ndarray | None = None  # host: [rows, page_size, num_bytes_per_token // 8] little-endian u64

    @property
    def num_token_slots(self) -> int:
        """How many slots this source covers: ``rows * page_size``."""
        return self.rows * self.page_size

    def words(self, mode: RealKVMode) -> int:
        """Number of u64 words a slot reads in ``mode``."""
        if mode == RealKVMode.NONE:
            return 0
        return (PARTIAL_BYTES if mode == RealKVMode.PARTIAL else self.read_bytes) // 8


def _positive_int(name: str, value: Any, *, multiple: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise fail(TypeError, f"{name}: expected an int, got {type(value).__name__}")
    v = int(value)
    if v <= 0 or v % multiple:
        what = "a positive int" if multiple == 1 else f"a positive multiple of {multiple}"
        raise fail(ValueError, f"{name}: expected {what}, got {v}")
    return v


def _as_byte_view(array: Any, name: str) -> ArrayView:
    check_layout(array, name)  # before the byte view below, which a sparse tensor fails with a misleading error
    if type(array).__module__ == "torch":
        # torch dtypes NumPy lacks (bfloat16, float8) do not cross DLPack into NumPy: view the bytes first.
        try:
            array = array.view(__import__("torch").uint8)
        except RuntimeError as exc:
            raise fail(ValueError, f"{name}: expected a tensor whose last axis is contiguous, got strides "
                                   f"{tuple(array.stride())}: {exc}") from exc
    try:
        return as_view(array, name)
    except (RuntimeError, BufferError, TypeError) as exc:
        raise fail(ValueError, f"{name}: could not be viewed as bytes zero-copy: {exc}") from exc


def real_kv_source(
    array: Any,
    *,
    page_size: int,
    num_bytes_per_token: int,
    read_bytes: int | None = None,
    name: str = "real_kv_sources[0]",
) -> RealKVSource:
    """Validate one source and view it as ``[rows, row_bytes]`` bytes, zero-copy.

    ``read_bytes`` defaults to ``num_bytes_per_token``. Raises ``ValueError`` / ``TypeError`` (SPEC 3.3 style).
    """
    ps = _positive_int(f"{name}.page_size", page_size)
    nbpt = _positive_int(f"{name}.num_bytes_per_token", num_bytes_per_token, multiple=BYTE_QUANTUM)
    rb = nbpt if read_bytes is None else _positive_int(f"{name}.read_bytes", read_bytes, multiple=BYTE_QUANTUM)
    if rb > nbpt:
        raise fail(ValueError, f"{name}.read_bytes: expected <= num_bytes_per_token = {nbpt}, got {rb}")
    view = _as_byte_view(array, f"{name}.array")
    if view.dtype.hasobject or view.dtype.itemsize == 0:
        raise fail(TypeError, f"{name}.array: expected an array of plain values (its bytes are hashed), got dtype "
                              f"{view.dtype}")
    if len(view.shape) < 2:
        raise fail(ValueError, f"{name}.array: expected at least 2 axes [rows, ...], got shape {view.shape}")
    itemsize = view.dtype.itemsize
    if view.shape[0] == 0:
        raise fail(ValueError, f"{name}.array: expected at least one row, got shape {view.shape}")
    # Inner axes (all but the first) must be C-contiguous so that a row is one run of bytes.
    want = 1
    for n, s in zip(reversed(view.shape[1:]), reversed(view.strides[1:])):
        if n > 1 and s != want:
            raise fail(ValueError, f"{name}.array: expected contiguous axes after the first (a row is one run of "
                                   f"bytes), got shape {view.shape} with element strides {view.strides}")
        want *= n
    rows = view.shape[0]
    row_bytes = want * itemsize
    # One row has no stride to check: use the smallest legal one (only row 0 is ever read).
    row_stride = view.strides[0] * itemsize if rows > 1 else -(-row_bytes // BYTE_QUANTUM) * BYTE_QUANTUM
    if row_stride < row_bytes:
        raise fail(ValueError, f"{name}.array: expected a row stride >= the row size {row_bytes} bytes, "
                               f"got {row_stride} bytes")
    if row_stride % BYTE_QUANTUM or view.ptr % BYTE_QUANTUM:
        raise fail(ValueError, f"{name}.array: expected 16-byte aligned rows, got base address {view.ptr:#x} and "
                               f"row stride {row_stride} bytes")
    if ps * nbpt > row_bytes:
        raise fail(ValueError, f"{name}: expected page_size * num_bytes_per_token <= row_bytes, got {ps} * {nbpt} = "
                               f"{ps * nbpt} > {row_bytes} (array shape {view.shape}, dtype {view.dtype})")
    host = words = None
    if view.device_id == HOST:
        host = host_view(view.ptr, (rows, row_bytes), (row_stride, 1), np.uint8, view.host, view.readonly)
        words = host_view(view.ptr, (rows, ps, nbpt // 8), (row_stride, nbpt, 8), "<u8", view.host, True)
    return RealKVSource(
        name=name, ptr=view.ptr, rows=rows, row_bytes=row_bytes, row_stride_bytes=row_stride, page_size=ps,
        num_bytes_per_token=nbpt, read_bytes=rb, device_id=view.device_id, owner=view.owner, bytes=host,
        words_view=words,
    )


@dataclass(frozen=True)
class RealKV:
    """Up to four validated sources and the mode; build with :func:`real_kv`."""

    sources: tuple[RealKVSource, ...]
    mode: RealKVMode
    device_id: int  # HOST (-1) when there are no sources

    @property
    def active(self) -> bool:
        """True when slots hash real bytes (mode not NONE and at least one source)."""
        return self.mode != RealKVMode.NONE and bool(self.sources)

    def check_covers(self, num_slots: int, name: str = "canary_buffer") -> None:
        """Every canary slot ``[0, num_slots)`` must have its bytes in every source (no out-of-bounds read)."""
        for src in self.sources:
            if src.num_token_slots < num_slots:
                raise fail(ValueError, f"{src.name}: expected rows * page_size >= the {num_slots} slots of {name}, "
                                       f"got {src.rows} * {src.page_size} = {src.num_token_slots}")


def real_kv(sources: Sequence[Any] = (), mode: Any = RealKVMode.ALL) -> RealKV:
    """Validate the real-KV description.

    ``sources``: up to 4 items, each a :class:`RealKVSource` (from :func:`real_kv_source`), a tuple
    ``(array, page_size, num_bytes_per_token[, read_bytes])`` or a dict of :func:`real_kv_source`'s keywords
    plus ``array``. ``mode``: :class:`RealKVMode`, its name or value. No sources means mode ``NONE``.
    """
    m = RealKVMode.coerce(mode)
    if any(hasattr(sources, a) for a in ("__array_interface__", "__cuda_array_interface__", "__dlpack__")):
        raise fail(TypeError, f"real_kv_sources: expected a sequence of sources such as [(array, page_size, "
                              f"num_bytes_per_token)], got one {type(sources).__name__} (wrap it in a list of tuples)")
    try:
        items = list(sources)
    except TypeError:
        raise fail(TypeError, f"real_kv_sources: expected a sequence of sources such as [(array, page_size, "
                              f"num_bytes_per_token)] (an empty one for none), got {type(sources).__name__}") from None
    if len(items) > MAX_SOURCES:
        raise fail(ValueError, f"real_kv_sources: expected at most {MAX_SOURCES} sources, got {len(items)}")
    built = []
    for i, item in enumerate(items):
        name = f"real_kv_sources[{i}]"
        if isinstance(item, RealKVSource):
            # Its fields are trusted by the kernels (rows bound every read): rebuilt from its array, they must agree.
            again = real_kv_source(item.owner, page_size=item.page_size, num_bytes_per_token=item.num_bytes_per_token,
                                   read_bytes=item.read_bytes, name=name)
            diff = [f for f in ("ptr", "rows", "row_bytes", "row_stride_bytes", "device_id")
                    if getattr(again, f) != getattr(item, f)]
            if diff:
                raise fail(ValueError, f"{name}: expected a RealKVSource that describes its array (as real_kv_source "
                                       f"makes it), got one with {', '.join(f'{f}={getattr(item, f)}' for f in diff)} "
                                       f"where its array gives {', '.join(f'{f}={getattr(again, f)}' for f in diff)}")
            built.append(item)
        elif isinstance(item, dict):
            unknown = set(item) - {"array", "page_size", "num_bytes_per_token", "read_bytes"}
            if unknown or "array" not in item:
                raise fail(TypeError, f"{name}: expected keys array, page_size, num_bytes_per_token[, read_bytes], "
                                      f"got {sorted(item)}")
            built.append(real_kv_source(name=name, **item))
        elif isinstance(item, tuple) and len(item) in (3, 4):
            built.append(real_kv_source(item[0], page_size=item[1], num_bytes_per_token=item[2],
                                        read_bytes=item[3] if len(item) == 4 else None, name=name))
        else:
            raise fail(TypeError, f"{name}: expected a RealKVSource, a dict or a tuple (array, page_size, "
                                  f"num_bytes_per_token[, read_bytes]), got {type(item).__name__}")
    device = built[0].device_id if built else HOST
    for src in built[1:]:
        if src.device_id != device:
            raise fail(ValueError, f"{src.name}: expected the device of {built[0].name} "
                                   f"({'host memory' if device == HOST else f'cuda:{device}'}), got "
                                   f"{'host memory' if src.device_id == HOST else f'cuda:{src.device_id}'}")
    if not built:
        m = RealKVMode.NONE
    return RealKV(sources=tuple(built), mode=m, device_id=device)


def _flat_words(src: RealKVSource, nwords: int) -> np.ndarray | None:
    """``[rows * page_size, num_bytes_per_token // 8]`` u64 view of every slot's words when the rows are packed
    back to back (the common layout), so that a slot is one index; ``None`` when the row stride leaves gaps.
    All of a token's words, not the first ``nwords``: the view is then C-contiguous, and ``np.take`` copies a
    non-contiguous source whole before gathering (6 MiB a call for the replay's V source, whatever the slot
    count); the extra words share the slot's cache lines, and the fold reads only the first ``nwords``."""
    view = src.words_view
    if src.rows > 1 and src.row_stride_bytes != src.page_size * src.num_bytes_per_token:
        return None
    return np.lib.stride_tricks.as_strided(view, shape=(src.num_token_slots, src.num_bytes_per_token // 8),
                                           strides=(src.num_bytes_per_token, 8), writeable=False)


def rows_of(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``a[rows]`` for in-range ``rows``: ``np.take`` is several times faster on packed rows, indexing on strided
    ones (measured on the replay's K and V sources)."""
    if a.strides[-1] == a.itemsize and a.strides[0] == a.itemsize * a.shape[-1]:
        return np.take(a, rows, axis=0, mode="clip")  # "clip" never buffers; the caller checked the range
    if a.ndim == 2 and a.strides[-1] == a.itemsize and a.shape[-1] > 0:
        # Rows contiguous inside, strided apart (the first bytes of each token): one opaque record per row makes
        # the gather a 1-D take, a third faster than fancy indexing over two axes.
        records = a.view(np.dtype((np.void, a.itemsize * a.shape[-1])))[:, 0]
        return np.take(records, rows, mode="clip").view(a.dtype).reshape(rows.shape[0], a.shape[-1])
    return a[rows]


def _fold_words(acc: np.ndarray, tmp: np.ndarray, flat: np.ndarray | None, view: np.ndarray, page_size: int,
                slots: np.ndarray, nwords: int) -> None:
    """``acc = splitmix64(acc ^ w)`` over the words ``w`` of each slot, in place; ``tmp``: scratch like ``acc``.
    One row gather per slot (a slot's words share a cache line; gathering word by word misses it once per word),
    and ``out=`` keeps the hash's temporaries out of the allocator."""
    if flat is not None:
        words = rows_of(flat, slots)
    else:
        words = view[slots // page_size, slots % page_size]
    for w in range(nwords):
        acc ^= words[:, w]
        splitmix64_into(acc, tmp)


def fold_source(src: RealKVSource, slots: np.ndarray, mode: RealKVMode) -> np.ndarray:
    """The per-source hash of each slot (uint64). ``slots``: int64 in ``[0, rows * page_size)``.

    This is the combine step's input, not a stored value: it may be 0 (all-zero bytes), and :func:`fold` forces the
    combined result odd.
    """
    if src.words_view is None:
        raise fail(ValueError, f"{src.name}: the reference fold needs host memory, got cuda:{src.device_id}")
    slots = np.asarray(slots, dtype=np.int64)
    acc = np.zeros(slots.shape[0], dtype=np.uint64)
    nwords = src.words(mode)
    if nwords == 0 or slots.shape[0] == 0:
        return acc
    view, flat = src.words_view[:, :, :nwords], _flat_words(src, nwords)
    tmp = np.empty(min(slots.shape[0], _FOLD_CHUNK_SLOTS), dtype=np.uint64)
    for lo in range(0, slots.shape[0], _FOLD_CHUNK_SLOTS):
        s = slots[lo : lo + _FOLD_CHUNK_SLOTS]
        _fold_words(acc[lo : lo + s.shape[0]], tmp[: s.shape[0]], flat, view, src.page_size, s, nwords)
    return acc


def fold(kv: RealKV, slots: Any) -> np.ndarray:
    """``real_kv_hash`` of each slot (int64 bit patterns), the reference of SPEC 4's real-KV fold.

    ``slots``: integers, each in ``[0, rows * page_size)`` of every source (``ValueError`` otherwise). With
    sources in mode PARTIAL or ALL every hash is odd (never the 0 of an unwritten record); otherwise all are 0.
    """
    s = np.asarray(slots, dtype=np.int64).reshape(-1)
    out = np.zeros(s.shape[0], dtype=np.uint64)
    if not kv.active or s.shape[0] == 0:
        return out.view(np.int64).reshape(np.shape(slots))
    lo, hi = int(s.min()), int(s.max())
    for src in kv.sources:
        if lo < 0 or hi >= src.num_token_slots:
            raise fail(ValueError, f"slots: expected values in [0, {src.num_token_slots}) for {src.name}, "
                                   f"got [{lo}, {hi}]")
    # Chunk by chunk, every source at once: a chunk's accumulators stay in cache across all the words it folds.
    tmp = np.empty(min(s.shape[0], _FOLD_CHUNK_SLOTS), dtype=np.uint64)
    part = np.empty_like(tmp)
    layouts = [(src, src.words(kv.mode)) for src in kv.sources]
    layouts = [(src, n, src.words_view[:, :, :n], _flat_words(src, n)) for src, n in layouts]
    for lo in range(0, s.shape[0], _FOLD_CHUNK_SLOTS):
        chunk = s[lo : lo + _FOLD_CHUNK_SLOTS]
        acc, t, p = out[lo : lo + chunk.shape[0]], tmp[: chunk.shape[0]], part[: chunk.shape[0]]
        for src, nwords, view, flat in layouts:
            p[...] = 0
            _fold_words(p, t, flat, view, src.page_size, chunk, nwords)
            acc ^= p
            splitmix64_into(acc, t)
    out |= np.uint64(1)  # never 0, the real_kv_hash of an unwritten record (module docstring)
    return out.view(np.int64).reshape(np.shape(slots))
