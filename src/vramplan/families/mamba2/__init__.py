"""Mamba-2 (state-space duality): transformers models/mamba2/modeling_mamba2.py."""
