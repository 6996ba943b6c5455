"""CI has no GPU: NVRTC (through cuda.core) still compiles the CUDA C sources, so a broken kernel fails CI.

The compile tests carry the ``sim`` marker (deselected by default: ``pytest -m sim`` runs them) and need
cuda-core, from the [sim] extra: they skip without it. The layout tests read the sources only and always run.
"""
import importlib.util
import re
from pathlib import Path

import pytest

from canary.backends.sources import cuda_source



def _has_cuda_core() -> bool:
    try:
        return importlib.util.find_spec("cuda.core") is not None
    except ModuleNotFoundError:  # not even the cuda namespace package
        return False


needs_nvrtc = pytest.mark.skipif(not _has_cuda_core(), reason="needs cuda-core for NVRTC: pip install -e '.[sim]'")

SPECIALIZATIONS = [(lut, pool) for lut in (False, True) for pool in (False, True)]


FORMS = {None: b"", 0: b"", 1: b"_blocks", 2: b"_pages"}  # CANARY_PLAN_FORM (None: plan.cu's default, 0)


@pytest.mark.sim
@needs_nvrtc
@pytest.mark.parametrize("padding_neg", [False, True], ids=["padding0", "padding-1"])
@pytest.mark.parametrize("form", list(FORMS), ids=["default", "req_to_token", "block_table", "page_list"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_plan_cu_compiles_every_specialization(arch, form, padding_neg):
    """One module per index form (SPEC 3.8; the CuPy host defines CANARY_PLAN_FORM) and padding slot (SPEC 3.2 "No
    reserved slot": CANARY_PADDING_NEG for padding_slot=-1), each with its four (LUT, pool) specializations and
    nothing else: req_to_token's kernels keep their names."""
    from cuda.core import Program, ProgramOptions

    macros = ([] if form is None else [("CANARY_PLAN_FORM", str(form))]) + (
        [("CANARY_PADDING_NEG", "1")] if padding_neg else [])
    define = {"define_macro": macros} if macros else {}
    # cubin, not PTX: cuda.core asks the (absent) driver whether it could load generated PTX.
    cubin = Program(cuda_source("plan"), "c++", ProgramOptions(arch=arch, std="c++17", **define)).compile("cubin").code
    symbols = set(re.findall(rb"canary_plan_\w+", cubin))
    want = set()
    for lut, pool in SPECIALIZATIONS:
        sfx = f"lut{int(lut)}_pool{int(pool)}".encode() + FORMS[form]
        want |= {b"canary_plan_" + kernel + b"_" + sfx for kernel in (b"fused", b"rows", b"entries")}
    assert want <= symbols
    assert not {s for s in symbols if re.fullmatch(rb"canary_plan_(fused|rows|entries)_lut\d_pool\d\w*", s)} - want


def test_plan_params_layout_matches_the_cuda_struct():
    """The CuPy backend packs PlanParams word by word: its field list must be the struct's, in order."""
    from canary.contract.plan_layout import CONSTANTS, PARAM_FIELDS

    src = cuda_source("plan")
    body = src[src.index("struct PlanParams {"):]
    body = body[: body.index("};")]
    fields = re.findall(r"\b(\w+);", body)
    assert tuple(fields) == PARAM_FIELDS
    for name, value in CONSTANTS.items():
        assert re.search(rf"#define {name} {value}\b", src), name


@pytest.mark.sim
@needs_nvrtc
@pytest.mark.parametrize("padding_neg", [False, True], ids=["padding0", "padding-1"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_canary_cu_compiles(arch, padding_neg):
    from cuda.core import Program, ProgramOptions

    define = {"define_macro": [("CANARY_PADDING_NEG", "1")]} if padding_neg else {}
    cubin = Program(cuda_source("records"), "c++", ProgramOptions(arch=arch, std="c++17", **define)
                    ).compile("cubin").code
    for kernel in (b"canary_write", b"canary_verify", b"canary_scatter_i64", b"canary_scatter_i32",
                   b"canary_append_tokens_i64", b"canary_append_tokens_i32"):
        assert kernel in cubin


@pytest.mark.sim
@needs_nvrtc
def test_fold_vectors_test_kernel_compiles():
    """The GPU suite's fold-vector kernel (helpers/hash_vectors.py) builds on records.cu's fold_slot: compile it
    here so that a change of the fold's signature or of RealKVParams fails without a GPU."""
    from cuda.core import Program, ProgramOptions
    from helpers.hash_vectors import FOLD_VECTORS_KERNEL

    src = cuda_source("records") + FOLD_VECTORS_KERNEL
    cubin = Program(src, "c++", ProgramOptions(arch="sm_90", std="c++17")).compile("cubin").code
    assert b"fold_vectors" in cubin


@pytest.mark.sim
@needs_nvrtc
def test_chain_vectors_test_kernel_compiles():
    """The GPU suite's chain-vector kernel builds on records.cu's chain_link and mulmod_p: compile it here."""
    from cuda.core import Program, ProgramOptions
    from helpers.hash_vectors import CHAIN_VECTORS_KERNEL

    src = cuda_source("records") + CHAIN_VECTORS_KERNEL
    cubin = Program(src, "c++", ProgramOptions(arch="sm_90", std="c++17")).compile("cubin").code
    assert b"chain_vectors" in cubin


def _struct_body(src: str, name: str) -> list[str]:
    body = src[src.index(f"struct {name} {{") :]
    body = body[body.index("{") + 1 : body.index("};")]
    return [line.split("//")[0].strip() for line in body.splitlines() if line.split("//")[0].strip()]


def _struct_fields(src: str, name: str, nested: dict) -> tuple:
    """Field names in order (``x[MAX_SOURCES]`` expands to x0..x3; nested structs expand to their fields)."""
    out: list = []
    for decl in _struct_body(src, name):
        m = re.fullmatch(r"(.*?)(\w+)(\[\w+\])?;", decl)
        ty, field, array = m.group(1).strip(), m.group(2), m.group(3)
        if ty in nested:
            out += nested[ty]
        elif array:
            out += [f"{field}{k}" for k in range(4)]
        else:
            out.append(field)
    return tuple(out)


def test_canary_params_layout_matches_the_cuda_structs():
    """The CuPy backend packs records.cu's structs word by word: the field lists must be the structs', in order,
    and every field 8 bytes (a pointer, i64 or u64; nested structs of those)."""
    from canary.contract import records_layout as L
    from canary.contract.hashes import ANCHOR_LINK
    from canary.contract.ring import CheckFlags, FailReason

    src = cuda_source("records")
    state = _struct_fields(src, "StateParams", {})
    kv = _struct_fields(src, "RealKVParams", {})
    assert state == L.STATE_FIELDS and kv == L.REAL_KV_FIELDS
    nested = {"StateParams": state, "RealKVParams": kv}
    assert _struct_fields(src, "WriteParams", nested) == L.WRITE_FIELDS
    assert _struct_fields(src, "VerifyParams", nested) == L.VERIFY_FIELDS
    assert _struct_fields(src, "ScatterParams", {}) == L.SCATTER_FIELDS
    assert _struct_fields(src, "AppendParams", {}) == L.APPEND_FIELDS
    for name in ("StateParams", "RealKVParams", "WriteParams", "VerifyParams", "ScatterParams", "AppendParams"):
        for decl in _struct_body(src, name):
            ty = re.fullmatch(r"(.*?)\w+(\[\w+\])?;", decl).group(1).strip()
            assert "*" in ty or ty in ("i64", "u64", "StateParams", "RealKVParams"), f"{name}: {decl}"
    for name, value in L.CONSTANTS.items():
        assert re.search(rf"#define {name} {value}\b", src), name
    for bit in FailReason:
        if bit:
            assert re.search(rf"#define FAIL_{bit.name} {int(bit)}\b", src), bit
    for flag in CheckFlags:
        if flag:
            assert re.search(rf"#define CHECK_{flag.name} {int(flag)}\b", src), flag
    assert f"#define ANCHOR_LINK 0x{ANCHOR_LINK & 0xFFFFFFFFFFFFFFFF:016X}ULL" in src
    from canary.contract import hashes

    for name in ("FIELD_P", "CHAIN_TAG", "CHAIN_MUL", "G_KEY"):
        assert re.search(rf"#define {name} 0x{getattr(hashes, name):016X}ULL\b", src), name


def _cuda_i64_define(src: str, name: str) -> int:
    """The value of ``#define NAME (-0x...LL)`` (the form of the int64 sentinels in the CUDA sources)."""
    m = re.search(rf"#define {name} \((-?)0x([0-9a-fA-F]+)LL\)", src)
    assert m, name
    return -int(m.group(2), 16) if m.group(1) else int(m.group(2), 16)


def test_missing_slot_is_the_same_everywhere():
    """MISSING_SLOT (SPEC 3.2) is written by the planners and recognized by verify: one value in the package, in
    plan.cu / records.cu (through the generated header) and in their Numba twins (imported from the same
    source), and out of reach of any int32 req_to_token value."""
    from canary import MISSING_SLOT
    from canary.contract import kernel_constants as K

    assert MISSING_SLOT == -(1 << 62) and MISSING_SLOT < -(1 << 31)
    assert K.CANARY_MISSING_SLOT == MISSING_SLOT
    assert _cuda_i64_define(cuda_source("plan"), "CANARY_MISSING_SLOT") == MISSING_SLOT
    assert _cuda_i64_define(cuda_source("records"), "CANARY_MISSING_SLOT") == MISSING_SLOT


def test_fused_grid_adds_one_cursor_block_to_a_sampling_planner():
    """plan.cu fused_sampled: the last block of a sampling planner's fused grid emits nothing and spins until the
    emitting blocks have counted in, so the grid must fit on the device at once (one wave)."""
    from canary.contract.plan_layout import ENTRY_THREADS, ITEMS, entry_grid, fused_grid

    per_block = ENTRY_THREADS * ITEMS
    for cap in (1, per_block, per_block + 1, 65536, 10**9):
        assert fused_grid(cap, 132, 4, sample=False) == entry_grid(cap, 132, 4)
    assert fused_grid(1, 132, 4, sample=True) == 2
    assert fused_grid(per_block + 1, 132, 4, sample=True) == 3
    assert fused_grid(10**9, 132, 4, sample=True) == 132 * 4  # a full wave, the cursor block included
    assert fused_grid(10**9, 1, 1, sample=True) == 2  # never fewer than one emitting block


def test_rows_grid_adds_side_blocks_to_a_sampling_planner_when_they_fit():
    """plan_side.cuh side_rows: a sampling planner's two-pass rows launch has one side block a tile of SIDE_ROWS rows
    of the batch capacity, up to one wave of the device (each reads every row), else one block."""
    from canary.contract.plan_layout import SIDE_ROWS, rows_grid, scratch_words, side_tiles

    assert rows_grid(4096, 132, 1, sample=False) == 1
    assert rows_grid(1, 132, 1, sample=True) == 2
    assert rows_grid(SIDE_ROWS, 132, 1, sample=True) == 2
    assert rows_grid(SIDE_ROWS + 1, 132, 1, sample=True) == 3
    assert rows_grid(131 * SIDE_ROWS, 132, 1, sample=True) == 132  # the whole device, block 0 included
    assert rows_grid(131 * SIDE_ROWS + 1, 132, 1, sample=True) == 1  # past one wave: block 0 builds the table
    assert rows_grid(3 * SIDE_ROWS, 2, 2, sample=True) == 4
    assert side_tiles(0) == 0 and side_tiles(SIDE_ROWS + 1) == 2
    assert scratch_words(SIDE_ROWS + 1, 7) - scratch_words(SIDE_ROWS, 7) == 11  # a row of the tables
    assert scratch_words(10, 8) - scratch_words(10, 7) == 1  # a request row's next cursor


@pytest.mark.sim
@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_report_cu_compiles(arch):
    """The manager's report kernel (CuPy only) compiles with its struct and block size from the generated header."""
    from cuda.core import Program, ProgramOptions

    cubin = Program(cuda_source("report"), "c++", ProgramOptions(arch=arch, std="c++17")).compile("cubin").code
    assert b"canary_report" in cubin


def test_report_params_layout_matches_the_cuda_struct():
    """canary/backends/cupy/report.py packs ReportParams word by word from report_layout's field list, which the
    generated header declares; the source reads its block size and slot layout from there."""
    from canary.contract.report_layout import REPORT_FIELDS

    src = cuda_source("report")
    body = src[src.index("struct ReportParams {"):]
    body = body[: body.index("};")]
    assert tuple(re.findall(r"\b(\w+);", body)) == REPORT_FIELDS
    assert "__launch_bounds__(REPORT_THREADS)" in src and "slot[REPORT_SLOT_HEADER_WORDS + i]" in src
    backend = Path(__file__).resolve().parents[2] / "canary" / "backends" / "cupy" / "report.py"
    assert "report_layout import REPORT_FIELDS as FIELDS" in backend.read_text()


@pytest.mark.sim
@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_agree_cu_compiles(arch):
    """The ranks' agreement kernel (SPEC 4.3) compiles with its struct and block size from the generated header."""
    from cuda.core import Program, ProgramOptions

    cubin = Program(cuda_source("agree"), "c++", ProgramOptions(arch=arch, std="c++17")).compile("cubin").code
    assert b"canary_agree" in cubin


def test_agree_params_layout_matches_the_cuda_struct():
    """canary/backends/cupy/agree.py packs AgreeParams word by word from agree_layout's field list, which the
    generated header declares; the kernel reads its block size and salts from there."""
    from canary.contract.agree_layout import AGREE_FIELDS

    src = cuda_source("agree")
    body = src[src.index("struct AgreeParams {"):]
    body = body[: body.index("};")]
    assert tuple(re.findall(r"\b(\w+);", body)) == AGREE_FIELDS
    assert "__launch_bounds__(AGREE_THREADS)" in src and "AGREE_PLAN_SALT" in src and "AGREE_ENTRY_SALT" in src
    backend = Path(__file__).resolve().parents[2] / "canary" / "backends" / "cupy" / "agree.py"
    assert "agree_layout import AGREE_FIELDS as FIELDS" in backend.read_text()
