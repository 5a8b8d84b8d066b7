"""gpt-oss has no hf layout yet (docs/gpt-oss.md, serving engines): every member refuses."""

from __future__ import annotations

from porter.errors import ConfigError

HF_ARCHITECTURES = ["GptOssForCausalLM"]


def check_hf_source(raw: dict, where: str = "config.json") -> None:
    raise ConfigError(f"{where}: --layout hf is not available for gpt-oss; use --layout porter")


def hf_config_json(raw, qconfig):
    raise ConfigError("--layout hf is not available for gpt-oss")


def hf_quantization_config(out, quantize, scale_rounding):
    raise ConfigError("--layout hf is not available for gpt-oss")


def hf_ignored_layers(out):
    raise ConfigError("--layout hf is not available for gpt-oss")


def hf_name(canonical):
    raise ConfigError("--layout hf is not available for gpt-oss")


def hf_canonical_map(names):
    raise ConfigError("--layout hf is not available for gpt-oss")
