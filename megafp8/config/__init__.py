"""Typed configuration: dataclasses, strict YAML loading, overrides and validation."""
from megafp8.config.errors import ConfigError
from megafp8.config.loader import dump_config, load_config, parse_overrides, resolve_config_path
from megafp8.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RopeScalingConfig,
    TrainingConfig,
)
from megafp8.config.sizes import MODEL_SIZES
from megafp8.config.validate import validate_config, validate_for_world

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LoggingConfig", "MODEL_SIZES", "ModelConfig",
    "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "RopeScalingConfig", "TrainingConfig", "dump_config",
    "load_config", "parse_overrides", "resolve_config_path", "validate_config", "validate_for_world",
]
