"""The manager's side of the layer rotation (docs/integration.md 5c): binding a group's
:class:`~canary.records.layers.CanaryLayers` and the two per-step launches around the group's own verify and write.

Order within a step (what makes the device cursor safe inside a CUDA graph): ``verify`` (the group's verify,
then ``verify_layer`` reading the cursor) in ``before_forward``; ``write`` (the group's write, then
``write_layers``, which advances the cursor) in ``after_kv_store``. All on the step's stream.
"""
from __future__ import annotations

from typing import Any

from ..errors import fail
from ..records.layers import CanaryLayers, check_dwell, rotation_mode


def bind_layers(index: int, spec: Any, records: Any, table: Any = None) -> CanaryLayers | None:
    """The rotation of group ``spec`` bound to its canary, or ``None`` when the group does not rotate.
    ``table``: the :class:`~canary.records.layers.LayerTable` to bind (a rebind's: the layer hashes already
    written, and the cursor, carried over), or ``None`` (a new zeroed one)."""
    if spec.layer_rotation not in (None, True, False):
        raise fail(TypeError, f"groups[{index}].layer_rotation: expected None, True or False, got "
                              f"{spec.layer_rotation!r}")
    if not spec.rotates_layers:
        return None
    if not spec.layer_sources:
        raise fail(ValueError, f"groups[{index}].layer_sources: expected the per-layer sources when "
                               f"layer_rotation=True, got none")
    # Checked here first, so that the errors name the group's fields rather than CanaryLayers' keywords.
    rotation_mode(spec.layer_real_kv_mode, f"groups[{index}].layer_real_kv_mode")
    check_dwell(spec.layer_dwell, f"groups[{index}].layer_dwell")
    return CanaryLayers(records, spec.layer_sources, mode=spec.layer_real_kv_mode, dwell=spec.layer_dwell,
                        table=table)


def verify_layers(g: Any, stream: Any) -> None:
    """After the group's verify: check the cursor's layer of the step's verified slots."""
    if g.layers is not None:
        g.layers.verify(g.verify_plan, launch_tag=g.verify_tag, stream=stream)


def write_layers(g: Any, out_cache_loc: Any, stream: Any) -> None:
    """After the group's write: refresh every layer's hashes of the step's slots, advance the cursor."""
    if g.layers is not None:
        g.layers.write(g.write_plan, out_cache_loc=out_cache_loc, stream=stream)
