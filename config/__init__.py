"""The run config: one typed schema, validated before any model loads (config.schema)."""

from config.schema import RESUMABLE_KEYS, ConfigError, SimConfig, load_config

__all__ = ["RESUMABLE_KEYS", "ConfigError", "SimConfig", "load_config"]
