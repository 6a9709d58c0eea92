"""Typed, validated configuration: the schema, YAML files with dotted overrides, cross-field rules, secrets
and the algorithm presets."""

from unipg.config.loading import load_config, parse_override
from unipg.config.presets import ALGORITHMS
from unipg.config.schema import Config, RollbackConfig
from unipg.config.section import ConfigError

__all__ = ["ALGORITHMS", "Config", "ConfigError", "RollbackConfig", "load_config", "parse_override"]
