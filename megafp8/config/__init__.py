"""Typed configuration: dataclasses, strict YAML loading, overrides and validation."""
from megafp8.config.architecture import LayerSpec, describe_blocks, layer_spec, mtp_layer_spec
from megafp8.config.attention import AttentionConfig, GqaConfig, MlaConfig
from megafp8.config.errors import ConfigError, os_error_text
from megafp8.config.loader import (dump_config, load_config, parse_overrides, repeated_overrides,
                                   resolve_config_path)
from megafp8.config.moe import MoeConfig
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
from megafp8.config.validate import ignored_settings, validate_config, validate_for_world

__all__ = [
    "AttentionConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "GqaConfig", "LayerSpec",
    "LoggingConfig", "MODEL_SIZES", "MlaConfig", "ModelConfig", "MoeConfig", "OptimizerConfig", "ParallelConfig",
    "PrecisionConfig", "RopeScalingConfig", "TrainingConfig", "describe_blocks", "dump_config",
    "ignored_settings", "layer_spec", "load_config", "mtp_layer_spec", "os_error_text", "parse_overrides",
    "repeated_overrides", "resolve_config_path", "validate_config", "validate_for_world",
]
