"""Typed configuration: schema, YAML loading, dotted overrides. Imports no torch, Megatron or vLLM."""

from megatron_rl.config.loader import ConfigError, dump_config, explain, load_config, parse_override
from megatron_rl.config.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "dump_config", "explain", "load_config", "parse_override"]
