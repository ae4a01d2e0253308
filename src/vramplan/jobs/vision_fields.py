"""The optional vision settings each tower's processor reads (jobs/<family>.py): a setting
another tower ignores would leave the estimate unchanged while the user thinks it counted."""
from __future__ import annotations

from vramplan.spec import JobSpec, SpecError

_IMAGE_FIELDS = ("image_height", "image_width", "min_pixels", "max_pixels", "max_tiles")
_READS = {"VisionDesc": (), "Gemma3VisionDesc": (),  # fixed-size towers: every image resized to its side
          "InternVisionDesc": ("image_height", "image_width", "max_tiles"),
          "OnevisionDesc": ("image_height", "image_width"),
          "QwenVisionDesc": ("image_height", "image_width", "min_pixels", "max_pixels")}
_HINTS = {"max_tiles": "an InternVL setting", "min_pixels": "a Qwen-VL processor setting",
          "max_pixels": "a Qwen-VL processor setting"}


def refuse_unread(spec: JobSpec, tower: str) -> None:
    reads = _READS.get(tower)
    for name in _IMAGE_FIELDS if reads is not None else ():
        if getattr(spec.vision, name) is not None and name not in reads:
            what = _HINTS.get(name, "read by towers of native resolution (Qwen-VL, InternVL, LLaVA-OneVision)")
            raise SpecError(f"vision.{name}", f"is {what}; this model's processor does not read it (the estimate "
                            f"would not change), so drop it")


__all__ = ["refuse_unread"]
