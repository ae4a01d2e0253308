"""Gemma 3 multimodal (`model_type` gemma3, Gemma3ForConditionalGeneration): a SigLIP tower
at a fixed 896 px, a projector that average-pools its 64 x 64 patches to 16 x 16 = 256
tokens per image (Gemma3MultiModalProjector), and the Gemma 3 language model read from
`text_config` by catalog/hf.py (transformers models/gemma3/)."""
