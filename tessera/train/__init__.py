"""Config-driven training: ``tessera train CONFIG.yaml``."""

from tessera.train.config import Config, ConfigError, load_config, parse_config

__all__ = ["Config", "ConfigError", "load_config", "parse_config"]
