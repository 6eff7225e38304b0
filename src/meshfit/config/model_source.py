"""The model a run's model section describes: a preset with its overrides, or, when model.init_from names a
Hugging Face model folder, the model its config.json describes (the folder is the model: a preset or a
dimension that disagrees with it is refused, naming the field)."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshfit.config.files import ConfigError

DEFAULT_PRESET = "tiny"
# Fields that say how the model runs or trains, not which function its weights compute: they may differ
# from an init_from folder's config.json.
RUN_FIELDS = ("attention", "pad_vocab_to", "dropout", "moe_capacity_factor", "moe_aux_loss_coeff",
              "moe_bias_update_rate")


def resolve_model(section: Any) -> Any:  # ModelSection -> ModelConfig
    """The validated ModelConfig of a ModelSection; ConfigError naming the field or file."""
    from meshfit.models.hf import hf_config_file, model_from_hf_config

    overrides = {k: v for k, v in section.model_dump().items() if k not in ("preset", "init_from") and v is not None}
    try:
        config_file = hf_config_file(section.init_from) if section.init_from else None
        base = model_from_hf_config(config_file) if config_file else None
    except ValueError as exc:
        raise ConfigError(f"model.init_from: {exc}" if not str(exc).startswith("model.") else str(exc)) from None
    if base is None:
        cfg = with_overrides(_preset(section.preset or DEFAULT_PRESET), overrides)
    else:
        _check_agrees(section.preset, overrides, base, str(config_file))
        cfg = dataclasses.replace(base, **overrides)
    try:
        cfg.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return cfg


def _preset(name: str) -> Any:
    from meshfit.models import get_preset

    try:
        return get_preset(name)
    except ValueError as exc:
        raise ConfigError(f"model.preset: {exc}") from None


def with_overrides(base: Any, overrides: dict[str, Any]) -> Any:
    """`base` (a ModelConfig) with `overrides` (field -> value) applied, as the model section and --dims
    apply them: a new RoPE scaling starts without the old one's parameters."""
    from meshfit.models.config import ROPE_PARAMETERS

    if overrides.get("rope_scaling", base.rope_scaling) != base.rope_scaling:
        # Another scaling: the preset's parameters belonged to its own one.
        base = dataclasses.replace(base, **dict.fromkeys(ROPE_PARAMETERS))
    return dataclasses.replace(base, **overrides)


def _check_agrees(preset: str | None, overrides: dict[str, Any], model: Any, config_file: str) -> None:
    """Refuse a preset or an override that describes another model than the init_from folder's."""
    for key, value in overrides.items():
        if key not in RUN_FIELDS and getattr(model, key) != value:
            raise ConfigError(f"model.{key}={value!r} disagrees with {config_file}, which gives {key}="
                              f"{getattr(model, key)!r}: the model.init_from folder's config.json is the model; "
                              f"leave model.{key} unset")
    if preset is None:
        return
    named = _preset(preset)
    for field in dataclasses.fields(named):
        key = field.name
        if key not in RUN_FIELDS and getattr(named, key) != getattr(model, key):
            raise ConfigError(f"model.preset={preset} disagrees with {config_file}: the preset has {key}="
                              f"{getattr(named, key)!r}, config.json {getattr(model, key)!r}; leave model.preset "
                              "unset (the model.init_from folder's config.json is the model)")
