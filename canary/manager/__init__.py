"""The engine-facing host side (issue 13): :class:`CanaryManager` over :class:`KVGroup` s, reporting
:class:`SlotViolation` records (docs/integration.md). Imports no GPU library until a device is used."""
from .distributed import RankViolation, Ranks
from .groups import KVGroup
from .manager import CanaryManager
from .report import CanaryHealthError, CanaryViolationError, SlotViolation, Violations

__all__ = ["CanaryHealthError", "CanaryManager", "CanaryViolationError", "KVGroup", "RankViolation", "Ranks",
           "SlotViolation", "Violations"]
