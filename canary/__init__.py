"""kv-canary: GPU planning kernels that detect KV-cache corruption in LLM serving engines.

``import canary`` imports NumPy only; the CuPy and Numba backends import their libraries when first used,
and the replay application (``canary.replay``) is imported only by the ``kv-canary`` command.

Planning (SPEC 3, ``canary.plan``): :class:`CanaryPlanner`, :func:`launch_canary_plan_kernels`,
:class:`VerifyPlan`, :class:`WritePlan`, :data:`SKIP_SEED` (a write seed meaning "skip this padding row's
tokens"), :data:`MISSING_SLOT` (a verify slot meaning "this in-window position has no real slot": a 0 in its
``req_to_token`` row, or its SWA mapping cleared).
The canary records (SPEC 4, ``docs/records.md``, ``canary.records``):
:class:`CanaryState`, :class:`CanaryRecords` (write / verify / drain), :func:`real_kv` / :func:`real_kv_source`
(real KV bytes to hash), :class:`CanaryLayers` / :class:`LayerTable` / :func:`layer_kv` (the layer rotation:
every layer's real KV over time, ``docs/records.md`` 10), :class:`RecordMover` / :class:`MoveStatus` /
:class:`MoveFault` (records that move with the KV: SPEC 4.1), :class:`BlockDigest` / :func:`combine_digests` /
:class:`DigestStatus` / :data:`BAD_DIGEST` (a digest of KV bytes in flight, SPEC 4.2), :func:`scatter_expected_tokens`,
the decoded ring records (:class:`Violation`, :class:`FailReason`) and the hashes (:func:`splitmix64`, :func:`mix3`).
:func:`to_host` copies any array to
NumPy (a sync for device arrays). :class:`LaunchConfig`: launch choices at bind time.

The engine-facing manager (``docs/integration.md``, ``canary.manager``): :class:`CanaryManager` bound over
:class:`KVGroup` s, two calls per step, violations reported as :class:`SlotViolation` records,
:class:`CanaryViolationError` / :class:`CanaryHealthError`; per rank (SPEC 4.3): :class:`Ranks`, a
:class:`Communicator` (:class:`TorchDistributedCommunicator`, :class:`CupyNcclCommunicator`,
:class:`LocalCommunicator`), disagreements as :class:`RankViolation` records.
"""
from .backends.args import LaunchConfig
from .errors import BackendUnavailableError, CanaryInputError, PlanStatus
from .interop.collectives import Communicator, CupyNcclCommunicator, LocalCommunicator, TorchDistributedCommunicator
from .interop.hostcopy import to_host
from .manager import (
    CanaryHealthError, CanaryManager, CanaryViolationError, KVGroup, RankViolation, Ranks, SlotViolation, Violations,
)
from .plan.planner import CanaryPlanner, launch_canary_plan_kernels
from .contract.plans import MISSING_SLOT, SKIP_SEED, VerifyPlan, WritePlan
from .records.api import CanaryRecords, scatter_expected_tokens
from .contract.hashes import mix3, splitmix64
from .records.layers import CanaryLayers, LayerTable, layer_kv
from .records.move import RecordMover
from .contract.move_layout import MoveFault, MoveStatus
from .records.digest import BlockDigest
from .contract.digest import BAD_DIGEST, DigestStatus, combine_digests
from .contract.realkv import RealKV, RealKVMode, real_kv, real_kv_source
from .contract.ring import (
    DEFAULT_CHECK_FLAGS, CheckFlags, FailReason, Health, KernelTag, RingReport, Violation,
)
from .contract.state import CanaryState

__all__ = [
    "BAD_DIGEST",
    "DEFAULT_CHECK_FLAGS",
    "BackendUnavailableError",
    "BlockDigest",
    "CanaryHealthError",
    "CanaryInputError",
    "CanaryLayers",
    "CanaryManager",
    "CanaryPlanner",
    "CanaryRecords",
    "CanaryState",
    "CanaryViolationError",
    "CheckFlags",
    "Communicator",
    "CupyNcclCommunicator",
    "DigestStatus",
    "FailReason",
    "Health",
    "KVGroup",
    "KernelTag",
    "LaunchConfig",
    "LocalCommunicator",
    "LayerTable",
    "MISSING_SLOT",
    "MoveFault",
    "MoveStatus",
    "PlanStatus",
    "RealKV",
    "RankViolation",
    "Ranks",
    "RealKVMode",
    "RecordMover",
    "RingReport",
    "SKIP_SEED",
    "SlotViolation",
    "TorchDistributedCommunicator",
    "VerifyPlan",
    "Violation",
    "Violations",
    "WritePlan",
    "combine_digests",
    "launch_canary_plan_kernels",
    "layer_kv",
    "mix3",
    "real_kv",
    "real_kv_source",
    "scatter_expected_tokens",
    "splitmix64",
    "to_host",
]
__version__ = "0.1.0"
