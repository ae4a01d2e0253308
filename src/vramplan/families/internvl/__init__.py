"""InternVL (`model_type` internvl, the -hf conversions of InternVL 2.5 / 3): InternViT with
layer scale, pixel-shuffle projector, dynamic tiling (transformers models/internvl/,
models/got_ocr2/ image processor). The language model is read from `text_config`
(Qwen2 / Qwen2.5 for the sizes in the catalog) by catalog/hf.py."""
