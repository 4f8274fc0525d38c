"""Loading a model's multimodal processor, also where its video processor cannot be built.

transformers' video processors (e.g. the one Qwen3VLProcessor - which Qwen3.5-VL maps to - holds) need
torchvision. Without it ``AutoProcessor.from_pretrained`` fails for every Qwen3.5-VL checkpoint, even
though training only needs the image processor (which has a PIL backend) and the tokenizer.
:func:`load_processor` then falls back to the checkpoint's own processor class with transformers' video
processor left out (:func:`without_video_processor`) and a PIL/numpy one in its place
(:class:`verl.utils.frames_video_processor.FramesVideoProcessor`): videos arrive as decoded frames.
"""

from __future__ import annotations

import json
import logging
import os
from functools import lru_cache

logger = logging.getLogger(__name__)

__all__ = ["load_processor", "without_video_processor"]


@lru_cache(maxsize=None)
def without_video_processor(processor_cls: type) -> type:
    """A subclass of ``processor_cls`` whose only saved sub-processors are the image processor and the tokenizer;
    videos go through a :class:`FramesVideoProcessor` built from the image processor.

    transformers derives a processor's sub-processors from its ``__init__`` signature, so leaving
    ``video_processor`` out of the signature is what makes loading, saving and type checks skip it. The class
    keeps the base class's name, so what it saves is the checkpoint's ordinary processor config.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        from verl.utils.frames_video_processor import FramesVideoProcessor

        processor_cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.video_processor = FramesVideoProcessor(image_processor)

    def __reduce__(self):
        # The class is made at run time; pickle it by its base class (dataset pickling, dataloader workers).
        return _rebuild, (processor_cls, self.__dict__.copy())

    cls = type(processor_cls.__name__, (processor_cls,), {"__init__": __init__, "__reduce__": __reduce__,
                                                         "__module__": processor_cls.__module__})
    cls.__qualname__ = processor_cls.__qualname__
    return cls


def _rebuild(processor_cls: type, state: dict):
    obj = without_video_processor(processor_cls).__new__(without_video_processor(processor_cls))
    obj.__dict__.update(state)
    return obj


def _processor_class_name(path: str):
    """The processor class named by the checkpoint's processor/preprocessor config, or its model type's."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                cls_name = json.load(f).get("processor_class")
            if cls_name:
                return cls_name
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type = AutoConfig.from_pretrained(path).model_type
    return PROCESSOR_MAPPING_NAMES.get(model_type)


def load_processor(path: str, trust_remote_code: bool = False):
    """``AutoProcessor.from_pretrained(path)``; where the video processor cannot be loaded (torchvision missing,
    or no video processor saved), the same processor class without it. Raises what AutoProcessor raises
    otherwise."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ImportError, OSError) as err:
        # ImportError: the video processor class needs torchvision. OSError: the checkpoint has no video
        # processor config (e.g. one saved without torchvision by this module).
        msg = str(err).lower()
        if "torchvision" not in msg and "video processor" not in msg:
            raise
        import transformers

        cls_name = _processor_class_name(path)
        base = getattr(transformers, cls_name, None) if cls_name else None
        if base is None or "video_processor" not in base.get_attributes():
            raise
        logger.warning("%s: the video processor is unavailable (%s); loading %s with a frames-only (PIL) video processor in its place",
                       path, type(err).__name__, cls_name)
        return without_video_processor(base).from_pretrained(path, trust_remote_code=trust_remote_code)
