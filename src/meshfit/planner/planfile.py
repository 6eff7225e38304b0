"""plan.json: the chosen layout with its model and workload, written by `meshfit plan --out` and run by
`meshfit train --plan`. One object, so what was planned is exactly what trains."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from meshfit.layout.layout import Layout, Workload
from meshfit.models.config import ModelConfig
from meshfit.planner.plan_consistency import consistency_error
from meshfit.planner.search import Candidate, Plan
from meshfit.util.jsonfile import read_json_object

FORMAT = "meshfit-plan/1"
# ModelConfig fields the config's model section accepts (all of them).
_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


def plan_document(plan: Plan, chosen: Candidate, top: int = 10) -> dict[str, Any]:
    doc = plan.to_json(top=top)
    doc["format"] = FORMAT
    doc["layout"] = chosen.layout.to_dict()
    doc["predicted"] = chosen.to_json()
    return doc


def write_plan(path: Path, plan: Plan, chosen: Candidate) -> None:
    """Write the plan file; its parts are first checked as `read_plan` checks them, so that what is written
    is what `meshfit train --plan` reads back."""
    doc = plan_document(plan, chosen)
    plan_parts(doc, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _section(path: Path, doc: dict[str, Any], name: str, cls: type) -> dict[str, Any]:
    """The fields of `cls` in the plan's object `name`; ValueError naming the file and a missing field."""
    section = doc.get(name)
    if not isinstance(section, dict):
        raise ValueError(f"{path}: \"{name}\" must be a JSON object (write plans with `meshfit plan … --out`)")
    fields = dataclasses.fields(cls)
    missing = [f.name for f in fields if f.name not in section
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{path}: missing field(s) {', '.join(f'{name}.{k}' for k in missing)}")
    return {f.name: section[f.name] for f in fields if f.name in section}


def read_plan(path: str | Path) -> tuple[ModelConfig, str, Workload, Layout]:
    """(model, model name, workload, layout) of a plan file; ValueError naming the file and the field."""
    path = Path(path)
    doc = read_json_object(path, "plan file", f"write one with `meshfit plan … --out {path}`")
    return plan_parts(doc, path)


def plan_parts(doc: dict[str, Any], path: Path) -> tuple[ModelConfig, str, Workload, Layout]:
    """The parts of a plan document, each checked and all checked against each other (plan_consistency.py);
    ValueError naming `path` and the field."""
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a meshfit plan (expected \"format\": \"{FORMAT}\")")
    model_fields = _section(path, doc, "model", ModelConfig)
    workload_fields = _section(path, doc, "workload", Workload)
    if not isinstance(doc.get("layout"), dict):
        raise ValueError(f"{path}: \"layout\" must be a JSON object (write plans with `meshfit plan … --out`)")
    try:
        model = ModelConfig(**model_fields)
        model.validate()
        workload = Workload(**workload_fields)
        workload.check()
        layout = Layout.from_dict(doc["layout"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if error := consistency_error(doc, model, workload, layout):
        raise ValueError(f"{path}: {error}. Its parts disagree, as in an edited plan: write the plan again with "
                         "`meshfit plan … --out`")
    return model, str(doc["model"]["name"]), workload, layout


def check_trainable(workload: Workload) -> None:
    """Refuse, naming the field, a workload the planner can reason about but meshfit does not train."""
    workload.check()
    if workload.precision == "bf16":
        raise ValueError("workload precision='bf16' (pure bf16 weights and optimizer states) is not a mode "
                         "meshfit trains: it trains bf16 as mixed precision with fp32 master weights; use "
                         "precision 'mixed' (meshfit plan --precision mixed)")
    if workload.optimizer != "adamw":
        raise ValueError(f"workload optimizer={workload.optimizer!r}: meshfit trains with AdamW only; use "
                         "optimizer 'adamw'")


def plan_sections(model: ModelConfig, workload: Workload, layout: Layout) -> dict[str, dict[str, Any]]:
    """The config sections that make `meshfit train` run this plan (typed values; a config file comes
    below them and the user's own --set on top, see `load_config`)."""
    check_trainable(workload)
    sections = layout.config_sections(workload.global_batch)
    sections["model"] = {k: getattr(model, k) for k in _MODEL_FIELDS}
    sections["model"]["attention"] = workload.attention  # the planned kernel is the one trained
    sections["train"].update(seq_len=workload.seq_len, global_batch=workload.global_batch)
    sections["parallel"]["mixed_precision"] = workload.precision == "mixed"
    if workload.compiled:  # the planned step is the compiled one
        sections["train"]["compile"] = True
    if workload.document_mask:  # the planned masks are the ones trained (the data must close documents by EOS)
        sections["data"] = {"document_mask": True}
    return sections
