"""Phi-1/1.5/2 (`model_type` phi): transformers models/phi/modeling_phi.py."""
