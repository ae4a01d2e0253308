"""Llama-4 text (llama4_text): adapter.py and forward.py."""
