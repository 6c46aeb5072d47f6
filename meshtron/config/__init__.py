"""Configuration: the schema (:mod:`.sections`), YAML and dotted overrides (:mod:`.parse`),
checks of each field (:mod:`.checks`), named model shapes (:mod:`.presets`) and field
documentation (:mod:`.docs`). Nothing here imports torch or any layer above it.
"""

from meshtron.config.checks import validate
from meshtron.config.generation_section import GenerationConfig
from meshtron.config.parse import (
    config_from_dict,
    load_config,
    parse_override,
    resolve,
    split_overrides,
)
from meshtron.config.presets import MODEL_PRESETS
from meshtron.config.sections import (
    MOE_DEFAULTS,
    SCHEDULES,
    SECTIONS,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
    config_key,
)
from meshtron.config.vision_section import VISION_DEFAULTS, VisionConfig

__all__ = [
    "split_overrides",
    "MODEL_PRESETS",
    "MOE_DEFAULTS",
    "SCHEDULES",
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "GenerationConfig",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "RunConfig",
    "TrainConfig",
    "VISION_DEFAULTS",
    "VisionConfig",
    "config_from_dict",
    "config_key",
    "load_config",
    "parse_override",
    "resolve",
    "validate",
]
