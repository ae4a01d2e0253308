"""LLaVA-OneVision (`model_type` llava_onevision, LlavaOnevisionForConditionalGeneration):
a SigLIP tower on the base image and its AnyRes tiles, a two-layer projector, the tiles'
features unpadded to the image's aspect, pooled down past `anyres_max_9` and ended by an
`image_newline` per row, and a Qwen2 language model from `text_config`
(transformers models/llava_onevision/)."""
