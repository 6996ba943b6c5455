"""The block digest of KV bytes in flight (SPEC 4.2): its constants, the layers' tensors it reads, and the host
helpers every backend shares (head keys, ``combine_digests``).

A block's digest is the sum mod 2^64 of one value per **lane** (a little-endian u64 word of a head's bytes):
``s(w ^ lane_key)`` with ``s = splitmix64`` and a key from the lane's logical identity (layer, K or V, head,
position, lane index), never from its address. So a change of one lane always changes the digest, the block's
layout in memory does not matter, and partial digests over disjoint heads or layers add up to the whole.

A tensor (:func:`digest_tensor`) is one caller array, any dtype, viewed zero-copy as bytes ``[num_pages,
page_size, heads, head_bytes]`` (4 axes) or ``[num_slots, heads, head_bytes]`` (3 axes: ``page_size = 1``), the
last axis contiguous, every other byte stride a multiple of 16 (the GPU twin loads 16 bytes at a time). Layers
(:func:`digest_layers`): ``num_layers`` items of 1 or 2 tensors (K, then V), one layout per kind.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import fail
from ..interop.adapter import HOST
from ..interop.memview import host_view
from .hashes import MASK64, splitmix64_u64
from .realkv import BYTE_QUANTUM, _as_byte_view
from .ring import MAX_LAYERS

DIGEST_ANCHOR = 0xB10CD16E57C0FFEE
DIGEST_LANE_MUL = 0x9E3779B97F4A7C15  # M: odd, so p * 2^12 + i -> key is a bijection mod 2^64
DIGEST_KEY0 = int(splitmix64_u64(DIGEST_ANCHOR)) & MASK64  # s(A): head_key's first step, a constant
LANE_BITS = 12  # lane index bits of a lane key: a head holds at most 2^12 lanes
MAX_HEAD_BYTES = 8 << LANE_BITS  # 32768
MAX_HEADS = 1024  # per tensor: the CUDA kernel keeps an item's head keys in shared memory
MAX_KINDS = 2  # K and V
BAD_DIGEST = -(1 << 63)  # the digest of a block whose status is not 0 (int64 bit pattern 0x8000000000000000)
MAX_OFFSET = 1 << 31  # layer_offset, head_offset (and the global indices they make) stay below this


class DigestStatus(enum.IntFlag):
    """Bits of a block's ``status`` (``compute``) and ``mismatch`` (``check``) byte (SPEC 4.2)."""

    OK = 0
    DIFFERS = 1  # check: the digest differs from the expected one
    BAD_PAGE = 2  # a page entry the block reads is outside [0, num_pages): its tokens are not read
    BAD_RANGE = 4  # the block's kv_indptr pair or its token count is bad: nothing of it is read
    EXPECTED_BAD = 8  # check: the expected digest is BAD_DIGEST (the sender's block was bad)


@dataclass(frozen=True)
class DigestTensor:
    """One validated tensor: byte strides (``page_stride``, ``token_stride``, ``head_stride``), sizes, where it
    lives; ``words`` is the host's ``[num_pages, page_size, heads, head_bytes // 8]`` little-endian u64 view."""

    name: str
    ptr: int
    num_pages: int
    page_size: int
    heads: int
    head_bytes: int
    page_stride: int
    token_stride: int
    head_stride: int
    device_id: int
    owner: Any
    words: np.ndarray | None

    @property
    def layout(self) -> tuple:
        return (self.num_pages, self.page_size, self.heads, self.head_bytes, self.page_stride, self.token_stride,
                self.head_stride)

    @property
    def span_bytes(self) -> int:
        """Bytes from ``ptr`` to one past the last byte a read can touch."""
        return ((self.num_pages - 1) * self.page_stride + (self.page_size - 1) * self.token_stride
                + (self.heads - 1) * self.head_stride + self.head_bytes)


def digest_tensor(array: Any, name: str = "layers[0][0]") -> DigestTensor:
    """Validate one tensor (module docstring) and view it zero-copy. ``TypeError`` / ``ValueError``
    (``kv-canary:``, naming ``name``) for a rank other than 3 or 4, an empty axis, a non-contiguous last axis, a
    head of bytes not a positive multiple of 16 or over 32768, more than 1024 heads, strides or a base address
    not multiples of 16."""
    view = _as_byte_view(array, f"{name}")
    if view.dtype.hasobject or view.dtype.itemsize == 0:
        raise fail(TypeError, f"{name}: expected an array of plain values (its bytes are hashed), got dtype "
                              f"{view.dtype}")
    shape, item = view.shape, view.dtype.itemsize
    if len(shape) not in (3, 4):
        raise fail(ValueError, f"{name}: expected shape [num_pages, page_size, heads, head_dim] or [num_slots, "
                               f"heads, head_dim], got shape {shape}")
    if 0 in shape:
        raise fail(ValueError, f"{name}: expected no empty axis, got shape {shape}")
    if shape[-1] > 1 and view.strides[-1] != 1:
        raise fail(ValueError, f"{name}: expected a contiguous last axis (a head is one run of bytes), got element "
                               f"strides {view.strides}")
    head_bytes = shape[-1] * item
    if head_bytes % BYTE_QUANTUM or head_bytes > MAX_HEAD_BYTES:
        raise fail(ValueError, f"{name}: expected a head of a multiple of 16 bytes, at most {MAX_HEAD_BYTES}, got "
                               f"{shape[-1]} x {item} = {head_bytes} bytes")
    pages, ps, heads = (shape[0], shape[1], shape[2]) if len(shape) == 4 else (shape[0], 1, shape[1])
    if heads > MAX_HEADS:
        raise fail(ValueError, f"{name}: expected at most {MAX_HEADS} heads, got {heads}")
    st = [s * item for s in view.strides[:-1]]
    page_stride, token_stride, head_stride = (st[0], st[1], st[2]) if len(shape) == 4 else (st[0], 0, st[1])
    # An axis of length one is never stepped along: its stride is whatever the exporter says; use 0.
    page_stride = page_stride if pages > 1 else 0
    token_stride = token_stride if ps > 1 else 0
    head_stride = head_stride if heads > 1 else 0
    for what, s in (("page", page_stride), ("token", token_stride), ("head", head_stride)):
        if s % BYTE_QUANTUM:
            raise fail(ValueError, f"{name}: expected a {what} stride that is a multiple of 16 bytes, got {s} bytes "
                                   f"(element strides {view.strides}, dtype {view.dtype})")
    if view.ptr % BYTE_QUANTUM:
        raise fail(ValueError, f"{name}: expected a base address aligned to 16 bytes, got {view.ptr:#x}")
    words = None
    if view.device_id == HOST:
        words = host_view(view.ptr, (pages, ps, heads, head_bytes // 8), (page_stride, token_stride, head_stride, 8),
                          "<u8", view.host, True)
    return DigestTensor(name, view.ptr, pages, ps, heads, head_bytes, page_stride, token_stride, head_stride,
                        view.device_id, view.owner, words)


@dataclass(frozen=True)
class DigestLayers:
    """Validated layers: ``layers[l][k]`` is kind ``k`` (0 K, 1 V) of layer ``l``; offsets as SPEC 4.2."""

    layers: tuple[tuple[DigestTensor, ...], ...]
    layer_offset: int
    head_offset: int
    device_id: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kinds(self) -> int:
        return len(self.layers[0])

    @property
    def num_pages(self) -> int:
        return self.layers[0][0].num_pages

    @property
    def page_size(self) -> int:
        return self.layers[0][0].page_size

    def kind(self, k: int) -> DigestTensor:
        """Layer 0's tensor of kind ``k``: the layout every layer's shares."""
        return self.layers[0][k]

    def base_pointers(self) -> np.ndarray:
        """``[num_layers * num_kinds]`` int64: kind ``k`` of layer ``l`` at ``l * num_kinds + k``."""
        return np.array([t.ptr for layer in self.layers for t in layer], dtype=np.int64)

    def lane_bytes(self) -> int:
        """KV bytes one token of a block reads, all layers and kinds together."""
        return self.num_layers * sum(self.kind(k).heads * self.kind(k).head_bytes for k in range(self.num_kinds))


def _offset(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise fail(TypeError, f"{name}: expected an int, got {type(value).__name__}")
    if not 0 <= int(value) < MAX_OFFSET:
        raise fail(ValueError, f"{name}: expected an int in [0, 2**31), got {value}")
    return int(value)


def digest_layers(layers: Any, *, layer_offset: int = 0, head_offset: int = 0) -> DigestLayers:
    """Validate the layers' tensors (module docstring): a :class:`DigestLayers` (returned as is) or a sequence of
    ``num_layers`` (1 to 65536) items, each a sequence of 1 or 2 tensors (K, then V). Every layer has as many
    tensors as layer 0, each of layer 0's layout for its kind, on one device; every kind has the same pages and
    page size. ``layer_offset``, ``head_offset``: ints in ``[0, 2**31)``, with ``layer_offset + num_layers`` and
    ``head_offset + heads`` at most ``2**31``. Errors name ``layers[l][k]``."""
    if isinstance(layers, DigestLayers):
        return layers
    lo, ho = _offset("layer_offset", layer_offset), _offset("head_offset", head_offset)
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise fail(TypeError, f"layers: expected a sequence of per-layer lists [k, v], got {type(layers).__name__}")
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise fail(ValueError, f"layers: expected 1 to {MAX_LAYERS} layers, got {len(layers)}")
    if lo + len(layers) > MAX_OFFSET:
        raise fail(ValueError, f"layer_offset: expected layer_offset + num_layers <= 2**31, got {lo} + {len(layers)}")
    out = []
    for li, item in enumerate(layers):
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence):
            raise fail(TypeError, f"layers[{li}]: expected a list of 1 or 2 tensors [k, v], got "
                                  f"{type(item).__name__}")
        if not 1 <= len(item) <= MAX_KINDS:
            raise fail(ValueError, f"layers[{li}]: expected 1 or 2 tensors [k, v], got {len(item)}")
        tensors = tuple(digest_tensor(t, f"layers[{li}][{k}]") for k, t in enumerate(item))
        if out:
            first = out[0]
            if len(tensors) != len(first):
                raise fail(ValueError, f"layers[{li}]: expected {len(first)} tensors, as layers[0] has, got "
                                       f"{len(tensors)}")
            for k, (a, b) in enumerate(zip(first, tensors)):
                if a.layout != b.layout:
                    raise fail(ValueError, f"layers[{li}][{k}]: expected layers[0][{k}]'s layout (pages, page_size, "
                                           f"heads, head_bytes, byte strides) {a.layout}, got {b.layout}")
                if a.device_id != b.device_id:
                    raise fail(ValueError, f"layers[{li}][{k}]: expected the device of layers[0][0], got another")
        else:
            for k, t in enumerate(tensors[1:], start=1):
                if (t.num_pages, t.page_size) != (tensors[0].num_pages, tensors[0].page_size):
                    raise fail(ValueError, f"layers[0][{k}]: expected layers[0][0]'s pages and page size "
                                           f"({tensors[0].num_pages}, {tensors[0].page_size}), got "
                                           f"({t.num_pages}, {t.page_size})")
                if t.device_id != tensors[0].device_id:
                    raise fail(ValueError, f"layers[0][{k}]: expected the device of layers[0][0], got another")
            for k, t in enumerate(tensors):
                if ho + t.heads > MAX_OFFSET:
                    raise fail(ValueError, f"head_offset: expected head_offset + heads <= 2**31, got {ho} + "
                                           f"{t.heads}")
        out.append(tensors)
    return DigestLayers(tuple(out), lo, ho, out[0][0].device_id)


def head_keys(layer: int, kind: int, heads: int, head_offset: int = 0) -> np.ndarray:
    """``[heads]`` uint64: ``head_key(layer, kind, head_offset + h) = s(s(DIGEST_KEY0 ^ (2 layer + kind)) ^ h)``
    for global ``layer`` (SPEC 4.2)."""
    v = np.full(heads, np.uint64(DIGEST_KEY0 ^ ((2 * int(layer) + int(kind)) & MASK64)), dtype=np.uint64)
    v = splitmix64_u64(v)
    v ^= np.arange(head_offset, head_offset + heads, dtype=np.uint64)
    return splitmix64_u64(v)


def combine_digests(parts: Sequence[Any]) -> np.ndarray:
    """The digests of the union of disjoint parts (tensor-parallel ranks' heads, pipeline stages' layers): the
    element-wise sum mod 2^64 of ``parts`` (each ``[nb]`` int64 or uint64, host arrays), ``BAD_DIGEST`` wherever
    a part is. Returns ``[nb]`` int64. On a device the partials of good blocks combine by a plain wrapping add.
    ``ValueError`` for no parts or parts of different lengths, ``TypeError`` for another dtype."""
    arrays = [np.asarray(p) for p in parts]
    if not arrays:
        raise fail(ValueError, "parts: expected at least one array of digests, got none")
    n = arrays[0].shape
    acc = np.zeros(n, dtype=np.uint64)
    bad = np.zeros(n, dtype=bool)
    for i, a in enumerate(arrays):
        if a.dtype not in (np.dtype(np.int64), np.dtype(np.uint64)):
            raise fail(TypeError, f"parts[{i}]: expected dtype int64 or uint64, got {a.dtype}")
        if a.ndim != 1 or a.shape != n:
            raise fail(ValueError, f"parts[{i}]: expected shape {n}, as parts[0], got {a.shape}")
        u = a.view(np.uint64)
        bad |= u == np.uint64(BAD_DIGEST & MASK64)
        acc += u  # wraps mod 2^64
    acc[bad] = np.uint64(BAD_DIGEST & MASK64)
    return acc.view(np.int64)
