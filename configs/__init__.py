"""Configuration: schema, YAML loading, validation against the model, memory plan.

Imports no torch, so the launcher validates a config before any rank starts.
"""

from meshserve.configs.errors import ConfigError
from meshserve.configs.config_file import load_config
from meshserve.configs.schema import Config

__all__ = ["Config", "ConfigError", "load_config"]
