"""Configuration of the tiny Kimi-style target: DeepSeek-V3 (MLA + MoE) under its own model_type.

transformers does not know the model_type "tiny_kimi", so config.json's auto_map must point here and
loading needs trust_remote_code, as it does for Kimi-K2.5.
"""

from transformers import DeepseekV3Config


class TinyKimiConfig(DeepseekV3Config):
    model_type = "tiny_kimi"


__all__ = ["TinyKimiConfig"]
