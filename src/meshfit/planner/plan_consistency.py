"""A plan file's parts against each other: its cluster, its layout and the layout its prediction is for,
its model's name and size, and whether the layout can train the model on the workload.

`meshfit plan --out` writes parts that agree; a plan file whose parts disagree was edited (or written by
hand), and training it would run something other than what was planned, so it is refused naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshfit.layout.layout import Layout, Workload
from meshfit.models.config import ModelConfig, num_params
from meshfit.planner.layout_check import PLAN_FIELDS, layout_fit_error

_CLUSTER_SIZES = ("nodes", "gpus_per_node", "world_size")


def consistency_error(doc: dict[str, Any], model: ModelConfig, workload: Workload, layout: Layout) -> str | None:
    """None when the plan's parts agree; else the first disagreement, naming the field(s)."""
    return (_cluster_error(doc.get("cluster"), layout) or _prediction_error(doc.get("predicted"), layout)
            or _model_error(doc["model"], model) or layout_fit_error(model, layout, workload, PLAN_FIELDS))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _cluster_error(cluster: object, layout: Layout) -> str | None:
    """cluster.world_size is cluster.nodes × cluster.gpus_per_node, and the ranks the layout spans."""
    if not isinstance(cluster, dict):
        return "\"cluster\" must be a JSON object with nodes, gpus_per_node and world_size"
    for key in _CLUSTER_SIZES:
        if not _positive_int(cluster.get(key)):
            return f"cluster.{key}={cluster.get(key)!r} must be a positive integer"
    nodes, per_node, world = (cluster[key] for key in _CLUSTER_SIZES)
    if world != nodes * per_node:
        return (f"cluster.world_size={world} is not cluster.nodes × cluster.gpus_per_node = {nodes} × {per_node} "
                f"= {nodes * per_node}")
    if layout.world_size != world:
        return (f"cluster.world_size={world}, but the layout spans {layout.world_size} ranks (layout.pp × "
                f"dp_replicate × dp_shard × cp × tp: {layout.describe()})")
    return None


def _prediction_error(predicted: object, layout: Layout) -> str | None:
    """The layout is the one the plan's prediction (memory, step time) was made for."""
    planned = predicted.get("layout") if isinstance(predicted, dict) else None
    if not isinstance(planned, dict):
        return "\"predicted\" must be a JSON object holding the planned \"layout\""
    changed = [f"layout.{key}={value!r} (predicted.layout.{key}={planned.get(key)!r})"
               for key, value in layout.to_dict().items() if planned.get(key) != value]
    if changed:
        return f"{', '.join(changed)}: the layout is not the one the plan's prediction was made for"
    return None


def _model_error(section: dict[str, Any], model: ModelConfig) -> str | None:
    """model.name, when it names a preset, has that preset's shape; model.params counts the model's."""
    from meshfit.models.presets import PRESETS

    name = section.get("name")
    if not isinstance(name, str) or not name:
        return f"model.name={name!r} must be the model's name (a preset, or the name of its config.json)"
    preset = PRESETS.get(name)
    if preset is not None and preset != model:
        differ = [f"model.{f.name}={getattr(model, f.name)!r} ({name}: {getattr(preset, f.name)!r})"
                  for f in dataclasses.fields(ModelConfig) if getattr(model, f.name) != getattr(preset, f.name)]
        return f"model.name={name!r} is a preset, but the model is not its shape: {', '.join(differ)}"
    params = section.get("params")
    if params != num_params(model):
        return f"model.params={params!r}, but the model's fields make {num_params(model)} parameters"
    return None
