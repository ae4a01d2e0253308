"""Baichuan 2 (`model_type` baichuan): repository code only (modeling_baichuan.py), RoPE in the
7B models and ALiBi in the 13B models."""
