"""Jamba: Mamba (v1) and attention layers with mixture-of-experts feed-forwards,
transformers models/jamba/modeling_jamba.py."""
