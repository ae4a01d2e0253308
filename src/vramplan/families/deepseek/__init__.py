"""DeepSeek-V2 and V3 (R1 is V3): multi-head latent attention and routed + shared experts.
transformers models/deepseek_v2/modeling_deepseek_v2.py, models/deepseek_v3/modeling_deepseek_v3.py."""
