"""GLM-4 (`model_type` glm4, THUDM/glm-4-9b-hf, GLM-4-0414): transformers models/glm4/modeling_glm4.py."""
