"""kv-canary: GPU planning kernels that detect KV-cache corruption in LLM serving engines.

``import canary`` imports NumPy only; the CuPy and Numba backends import their libraries when first used.
"""
from .errors import BackendUnavailableError, CanaryInputError, PlanStatus
from .planner import CanaryPlanner, launch_canary_plan_kernels
from .plans import VerifyPlan, WritePlan

__all__ = [
    "BackendUnavailableError",
    "CanaryInputError",
    "CanaryPlanner",
    "PlanStatus",
    "VerifyPlan",
    "WritePlan",
    "launch_canary_plan_kernels",
]
__version__ = "0.1.0"
