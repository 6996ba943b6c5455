"""Tensor parallelism in transformers' continuous batching (canary.integrations.transformers): one canary per
tensor-parallel rank, agreeing each step with the other ranks of its group (SPEC 4.3).

transformers 5.17 runs continuous batching under tensor parallelism (a model loaded with
``distributed_config=DistributedConfig(tp_size=N)`` or ``tp_plan="auto"``, one process per rank): every rank runs
the same generation loop, the TP driver (TP rank 0) broadcasting the new requests and cancellations each step, so
that every rank schedules the same batches and allocates the same blocks; each rank's ``PagedAttentionCache`` holds
its own ``num_key_value_heads / tp_size`` KV heads. The engine's ``DistributedHelper``
(``processor.distributed_helper``) names the rank: ``tp_size``, ``tp_local_rank``, ``dp_rank`` / ``dp_size``, the
TP process group ``tp_group`` and a gloo group over the same ranks, ``cpu_comm_group``.

So each rank's session builds its :class:`canary.CanaryManager` as on one device, over its own cache (its records
and the real-KV hash of its own heads), with ``ranks=Ranks(tp_rank, tp_size, dp_rank=..., dp_size=...)`` and
``communicator=TorchDistributedCommunicator(cpu_comm_group)``. The engine's gloo group, not its TP group: the
agreement's all-reduce is 104 bytes of host int64 words a step, which gloo reduces on the host with no device
work, while on NCCL it would be copied to the GPU, ordered behind the group's collectives of the forward and read
back (canary/interop/collectives.py). The engine uses that group on the same thread (its per-step state
all-reduce and request broadcast), and every rank calls the canary in the same order, so the two interleave the
same way on every rank.

The canary's step calls are collectives there (SPEC 4.3, "When"): they are made on the generation loop's thread,
by a glue whose every decision (admission, rows, padding, whether a step has a protected row) reads only what
every rank holds alike (the batch, the block tables, the request states); the session closes at the loop's end on
every rank. Data-parallel replicas agree on nothing (labels only, by design); pipeline stages, expert parallelism
and FSDP are refused (:func:`refusals`).
"""
from __future__ import annotations

from typing import Any

from canary import Ranks, TorchDistributedCommunicator


def refusals(model: Any) -> list[str]:
    """The distributed setups the canary refuses on ``model`` (a ``PreTrainedModel``): one line each, [] when
    none. Tensor parallelism (a ``tp`` mesh, or an unnamed one: the engine reads that as TP) and data-parallel
    replicas beside it are supported."""
    out = []
    dc = getattr(model.config, "distributed_config", None)
    pp = int(getattr(dc, "pp_size", 1) or 1)
    if pp > 1:
        out.append(f"pipeline parallelism (distributed_config.pp_size={pp}): tensor parallelism only")
    if dc is not None and getattr(dc, "enable_expert_parallel", False):
        out.append("expert parallelism (distributed_config.enable_expert_parallel=True): tensor parallelism only")
    mesh = getattr(model, "_device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) if mesh is not None else None
    other = [n for n in (names or ()) if n not in ("tp", "dp") and mesh[n].size() > 1]
    if other:
        out.append(f"a device mesh with {', '.join(other)} dimensions ({dict(zip(names, mesh.shape))}): tensor "
                   f"parallelism (and data-parallel replicas) only")
    return out


def distributed(processor: Any, fail: Any) -> dict[str, Any]:
    """The :class:`canary.CanaryManager` keyword arguments of ``processor``'s rank: ``{}`` on one rank (TP off),
    else ``ranks`` and ``communicator`` (the engine's gloo ``cpu_comm_group``). ``fail(exc, message)`` makes the
    ``kv-canary:`` error raised when the engine has TP on but no CPU group (``ValueError``)."""
    helper = getattr(processor, "distributed_helper", None)
    size = int(getattr(helper, "tp_size", 1) or 1)
    if size <= 1:
        return {}
    group = getattr(helper, "cpu_comm_group", None)
    if group is None:
        raise fail(ValueError, f"distributed_helper: expected the engine's gloo cpu_comm_group with tp_size={size}, "
                               f"got none (destroyed: a manager reused after destroy()?)")
    ranks = Ranks(tp_rank=int(helper.tp_local_rank), tp_size=size, dp_rank=int(helper.dp_rank),
                  dp_size=int(helper.dp_size))
    return {"ranks": ranks, "communicator": TorchDistributedCommunicator(group)}
