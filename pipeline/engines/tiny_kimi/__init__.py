"""Code shipped inside the tiny Kimi-style target's model directory (see pipeline.engines.tiny_target).

Kimi-K2.5 ships its configuration, modeling and tokenizer code with its weights and is loaded with
trust_remote_code; the tiny target does the same with these files, copied next to its weights. They
import only transformers and tiktoken, never the pipeline, so they run wherever the directory goes.
"""
