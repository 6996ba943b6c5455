"""The manager's CUDA transfer path (report block, copies, memsets, staging) without a GPU: on the NumPy stand-in
for CuPy and the CUDA runtime of tests/helpers/fakecuda.py, in a child process (transfer_fake_child.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.fake_child import needs_cuda_bindings, run_fake_child

CHILD = Path(__file__).resolve().parent / "transfer_fake_child.py"


@needs_cuda_bindings
@pytest.mark.parametrize("report", ["kernel", "copy"])
def test_one_copy_each_way_per_step_and_violations_reported_one_step_late(report):
    run_fake_child(CHILD, report)
