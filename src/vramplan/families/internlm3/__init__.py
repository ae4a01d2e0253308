"""InternLM3 (internlm3): the Llama architecture under its own config class; adapter.py only."""
