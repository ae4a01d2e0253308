"""Qwen2-VL and Qwen2.5-VL (`model_type` qwen2_vl, qwen2_5_vl): the native-resolution vision
tower with its patch merger, and the image/video token arithmetic of their processors
(transformers models/qwen2_vl/, models/qwen2_5_vl/). The language model is Qwen2's layout
(q/k/v with bias) with M-RoPE, read by catalog/hf.py as model_type qwen2."""
