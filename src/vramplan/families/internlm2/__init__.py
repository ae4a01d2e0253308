"""InternLM2 / InternLM2.5 (`model_type` internlm2): repository code only (modeling_internlm2.py)."""
