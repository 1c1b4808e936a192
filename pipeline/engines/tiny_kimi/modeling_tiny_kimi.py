"""The tiny Kimi-style causal LM: transformers' DeepSeek-V3 model, bound to TinyKimiConfig."""

from transformers import DeepseekV3ForCausalLM

from .configuration_tiny_kimi import TinyKimiConfig


class TinyKimiForCausalLM(DeepseekV3ForCausalLM):
    config_class = TinyKimiConfig


__all__ = ["TinyKimiForCausalLM"]
