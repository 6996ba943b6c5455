"""The backend seam: what a backend receives, and how a backend is chosen and imported.

A backend is a module with ``NAME``, ``ON_DEVICE`` (bool) and ``bind(static: StaticArgs) -> Bound``; a
``Bound`` has ``launch(step: StepArgs, stream: int) -> None`` and ``warmup() -> None``. ``bind`` does
everything that does not change between calls (compilation, scratch allocation, argument packing); ``launch``
must not allocate, compile, load modules or sync on the GPU backends.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

from ..adapter import ArrayView
from ..errors import BackendUnavailableError, fail

BACKENDS = ("reference", "cupy", "numba")
# Module of each backend, per kernel family: the planner ("plan") and the canary write / verify ("canary").
_MODULES = {
    "plan": {"reference": "reference", "cupy": "cupy_backend", "numba": "numba_backend"},
    "canary": {"reference": "reference_canary", "cupy": "canary_cupy", "numba": "canary_numba"},
}


@dataclass(frozen=True)
class StaticArgs:
    """Everything a planner binds once. Views are already checked (SPEC 3.3)."""

    req_to_token: ArrayView  # [max_reqs, max_seq_len] int32, row stride >= max_seq_len
    full_to_swa_index_mapping: ArrayView | None  # [lut_len] int64
    req_to_verify_expected_tokens: ArrayView | None  # [pool_rows, pool_cols] int32
    swa_window_size: int
    kv_token_id_vs_position_offset: int
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
    device_id: int  # -1 for host

    @property
    def max_reqs(self) -> int:
        return self.req_to_token.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.req_to_token.shape[1]

    @property
    def req_pool_index_bound(self) -> int:
        """Exclusive upper bound of a valid ``req_pool_indices`` value (SPEC 3.4 bit 2)."""
        pool = self.req_to_verify_expected_tokens
        return self.max_reqs if pool is None else min(self.max_reqs, pool.shape[0])


@dataclass(frozen=True)
class StepArgs:
    """The per-step inputs, ``[bs]`` int64 each (``valid_lens`` present iff an expected-token pool is bound)."""

    req_pool_indices: ArrayView
    prefix_lens: ArrayView
    extend_seq_lens: ArrayView
    valid_lens: ArrayView | None
    bs: int


@dataclass(frozen=True)
class CanaryWriteArgs:
    """One write launch's inputs, checked (docs/canary.md 4): ``[R+1]``/``[R]`` int64 and ``[1]`` int32 plan
    arrays, ``[N]`` int64 entry arrays (the expected ones ``None`` when not given), the launch tag."""

    write_offsets: ArrayView
    write_seed_slot_indices: ArrayView
    write_num_valid_reqs: ArrayView
    out_cache_loc: ArrayView
    input_ids: ArrayView
    positions: ArrayView
    expected_input_ids: ArrayView | None
    expected_positions: ArrayView | None
    launch_tag: int


@dataclass(frozen=True)
class CanaryVerifyArgs:
    """One verify launch's inputs, checked (docs/canary.md 5): four ``[C]`` int64 arrays, ``[1]`` int32 count
    and enable, the launch tag."""

    verify_slot_indices: ArrayView
    verify_expected_tokens: ArrayView
    verify_expected_positions: ArrayView
    verify_prev_slot_indices: ArrayView
    verify_num_valid: ArrayView
    enable: ArrayView
    launch_tag: int


@dataclass(frozen=True)
class ScatterArgs:
    """One expected-token scatter's inputs, checked (docs/canary.md 7)."""

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


_INSTALL = {
    "cupy": "pip install 'kv-canary[cuda13]' (CUDA 13 driver) or 'kv-canary[cuda12]' (CUDA 12)",
    "numba": "pip install 'kv-canary[numba]' (numba-cuda with numpy<2.5)",
}


def import_cupy():
    """Import CuPy or raise :class:`BackendUnavailableError` with the install command."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(f"kv-canary: backend 'cupy' needs CuPy: {_INSTALL['cupy']}") from exc
    return cupy


def _numba_simulator() -> bool:
    import os

    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def load(name: str, family: str = "plan"):
    """Import backend module ``name`` of a kernel family ("plan" or "canary"); ``ValueError`` for unknown names."""
    if name not in BACKENDS:
        raise fail(ValueError, f"backend: expected one of {', '.join(('auto',) + BACKENDS)}, got {name!r}")
    return importlib.import_module(f"{__name__}.{_MODULES[family][name]}")


def _placement_message(name: str, what: str, where: str, fits: str) -> str:
    runs = "on the host" if name == "reference" else "on a CUDA device"
    return f"backend: expected a backend for {what} in {where} ({fits}), got {name!r}, which runs {runs}"


def resolve(name: str, device_id: int, family: str = "plan"):
    """Pick the backend module for ``name`` ("auto" included) and arrays living on ``device_id``."""
    what = f"the {family} arrays"
    if name == "auto":
        if device_id < 0:
            return load("reference", family)
        try:
            import_cupy()
            return load("cupy", family)
        except BackendUnavailableError:
            try:
                return load("numba", family)
            except BackendUnavailableError as exc:
                raise BackendUnavailableError(
                    f"kv-canary: backend 'auto' found CUDA arrays but neither CuPy nor numba-cuda: "
                    f"{_INSTALL['cupy']}, or {_INSTALL['numba']}"
                ) from exc
    if device_id < 0 and (name == "cupy" or (name == "numba" and not _numba_simulator())):
        # A caller error whatever is installed: say so before importing the backend's library. (Numba's CUDA
        # simulator runs on host memory: there the numba backend takes host arrays.)
        raise fail(ValueError, _placement_message(name, what, "host memory", "'reference' or 'auto'"))
    module = load(name, family)
    if module.ON_DEVICE and device_id < 0:
        raise fail(ValueError, _placement_message(name, what, "host memory", "'reference' or 'auto'"))
    if not module.ON_DEVICE and device_id >= 0:
        raise fail(ValueError, _placement_message(name, what, f"cuda:{device_id}", "'cupy', 'numba' or 'auto'"))
    return module


INT64 = np.dtype(np.int64)
INT32 = np.dtype(np.int32)


def _kernels_dir():
    """``kernels/``: the package ``canary.kernels`` once installed, or the folder beside ``canary/`` in a checkout
    whose ``canary`` shadows the installed one (``python -m canary`` from the repository root)."""
    from importlib import resources
    from pathlib import Path

    try:
        return resources.files("canary.kernels")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "kernels"


def cupy_backend_source(name: str = "plan") -> str:
    """The CUDA C source of the plan kernels (``kernels/plan.cu``) or of another ``kernels/<name>.cu``."""
    return _kernels_dir().joinpath(f"{name}.cu").read_text()


def import_kernel_module(name: str):
    """Import ``kernels/<name>.py`` (the Numba kernels) as ``canary.kernels.<name>``."""
    import importlib.util
    import sys

    full = f"canary.kernels.{name}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name not in (full, "canary.kernels"):
            raise  # a library the kernels need is missing, not the kernels
        if full in sys.modules:
            return sys.modules[full]
        path = _kernels_dir().joinpath(f"{name}.py")
        spec = importlib.util.spec_from_file_location(full, str(path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
        return module
