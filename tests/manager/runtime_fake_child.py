"""A CUDA manager imports its backend's library before its first per-step runtime call (canary/interop/cudart.py
runtime picks CuPy's binding only if CuPy is imported by then; run 139 found the transformers integration on
cuda.bindings). On tests/helpers/fakecuda.py; run by ``test_runtime_choice_fake.py``; prints ``OK``."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT))

import fakecuda  # noqa: E402

fakecuda.install()

import cupy  # noqa: E402 - the fake

import canary.backends as backends  # noqa: E402
import canary.interop.cudart as cudart  # noqa: E402
from canary import CanaryManager, KVGroup  # noqa: E402

order: list[str] = []


class Recording(dict):
    def get(self, key, default=None):
        order.append("runtime")
        return super().get(key, default)


cudart._CHOSEN = Recording()
resolve = backends.resolve


def recording_resolve(*args, **kwargs):
    order.append("resolve")
    return resolve(*args, **kwargs)


backends.resolve = recording_resolve
r2t = cupy.asarray(np.arange(4 * 16, dtype=np.int32).reshape(4, 16))
m = CanaryManager(KVGroup(name="full", req_to_token=r2t, num_slots=64, verify_capacity=64), max_batch_size=4,
                  device=0, backend="cupy", on_violation=lambda v: None)
assert "runtime" in order and order[0] == "resolve", order[:6]
assert cudart.runtime().name == "cupy", cudart.runtime().name
m.close()
print("OK")
