"""kv-canary: GPU planning kernels that detect KV-cache corruption in LLM serving engines.

``import canary`` imports NumPy only; the CuPy and Numba backends import their libraries when first used.

Planning (SPEC 3): :class:`CanaryPlanner`, :func:`launch_canary_plan_kernels`, :class:`VerifyPlan`,
:class:`WritePlan`. The canary itself (SPEC 4, ``docs/canary.md``): :class:`CanaryState`, :class:`KVCanary`
(write / verify / drain), :func:`real_kv` / :func:`real_kv_source` (real KV bytes to hash),
:func:`scatter_expected_tokens`, and the decoded ring records (:class:`Violation`, :class:`FailReason`).
"""
from .errors import BackendUnavailableError, CanaryInputError, PlanStatus
from .planner import CanaryPlanner, launch_canary_plan_kernels
from .plans import VerifyPlan, WritePlan
from .realkv import RealKVMode, real_kv, real_kv_source
from .ring import CanaryState, CheckFlags, FailReason, Health, KernelTag, RingReport, Violation
from .write_verify import KVCanary, scatter_expected_tokens

__all__ = [
    "BackendUnavailableError",
    "CanaryInputError",
    "CanaryPlanner",
    "CanaryState",
    "CheckFlags",
    "FailReason",
    "Health",
    "KVCanary",
    "KernelTag",
    "PlanStatus",
    "RealKVMode",
    "RingReport",
    "VerifyPlan",
    "Violation",
    "WritePlan",
    "launch_canary_plan_kernels",
    "real_kv",
    "real_kv_source",
    "scatter_expected_tokens",
]
__version__ = "0.1.0"
