"""CI has no GPU: NVRTC (through cuda.core) still compiles the CUDA C sources, so a broken kernel fails CI."""
import re

import pytest

from canary.backends import cupy_backend_source

cuda_core = pytest.importorskip("cuda.core", reason="cuda-core is part of the [test] extra")

SPECIALIZATIONS = [(lut, pool) for lut in (False, True) for pool in (False, True)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_plan_cu_compiles_every_specialization(arch):
    from cuda.core import Program, ProgramOptions

    # cubin, not PTX: cuda.core asks the (absent) driver whether it could load generated PTX.
    cubin = Program(cupy_backend_source(), "c++", ProgramOptions(arch=arch, std="c++17")).compile("cubin").code
    symbols = set(re.findall(rb"canary_plan_\w+", cubin))
    for lut, pool in SPECIALIZATIONS:
        sfx = f"lut{int(lut)}_pool{int(pool)}".encode()
        for kernel in (b"fused", b"rows", b"entries"):
            assert b"canary_plan_" + kernel + b"_" + sfx in symbols


def test_plan_params_layout_matches_the_cuda_struct():
    """The CuPy backend packs PlanParams word by word: its field list must be the struct's, in order."""
    from canary.backends.plan_layout import CONSTANTS, PARAM_FIELDS

    src = cupy_backend_source()
    body = src[src.index("struct PlanParams {"):]
    body = body[: body.index("};")]
    fields = re.findall(r"\b(\w+);", body)
    assert tuple(fields) == PARAM_FIELDS
    for name, value in CONSTANTS.items():
        assert re.search(rf"#define {name} {value}\b", src), name
