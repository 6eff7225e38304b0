"""The run configuration: typed sections (sections.py), read from TOML, YAML or JSON files (files.py) with
`--set` overrides on top (load.py). Its public names are importable from here."""

from meshfit.config.files import ConfigError
from meshfit.config.load import apply_overrides, config_from_dict, load_config
from meshfit.config.sections import (
    SECTIONS,
    CheckpointSection,
    Config,
    DataSection,
    MetricsSection,
    ModelSection,
    ParallelSection,
    PipelineSection,
    TrainSection,
)

__all__ = ["SECTIONS", "CheckpointSection", "Config", "ConfigError", "DataSection", "MetricsSection",
           "ModelSection", "ParallelSection", "PipelineSection", "TrainSection", "apply_overrides",
           "config_from_dict", "load_config"]
