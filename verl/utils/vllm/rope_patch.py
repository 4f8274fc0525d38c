"""Scoped fix for Qwen3.5 RoPE config validation between vLLM and transformers 5.

Some vLLM releases (seen with 0.18.x) hand ``ignore_keys_at_rope_validation`` to transformers as a *list*,
while transformers 5 does set arithmetic on it and fails with a ``TypeError`` while the engine builds the
Qwen3.5 config. :func:`rope_ignore_keys_as_set` converts the list to a set for the duration of engine
creation only, and only where transformers has ``convert_rope_params_to_dict`` (older releases lack it and
need nothing); the original method is restored afterwards, even on error.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

_KEY = "ignore_keys_at_rope_validation"


def _as_set(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if isinstance(kwargs.get(_KEY), (list, tuple)):
            kwargs[_KEY] = set(kwargs[_KEY])
        return fn(self, *args, **kwargs)

    wrapper._verl_rope_keys_patch = True
    return wrapper


@contextlib.contextmanager
def rope_ignore_keys_as_set(config_cls=None) -> Iterator[bool]:
    """Context manager; yields whether a patch was installed. ``config_cls`` defaults to PretrainedConfig."""
    if config_cls is None:
        from transformers import PretrainedConfig as config_cls
    # Look the method up on the class that defines it, so restoring puts back exactly what was there.
    owner = next((k for k in config_cls.__mro__ if "convert_rope_params_to_dict" in vars(k)), None)
    if owner is None:
        yield False
        return
    original = vars(owner)["convert_rope_params_to_dict"]
    if getattr(original, "_verl_rope_keys_patch", False):  # nested use: already patched
        yield True
        return
    setattr(owner, "convert_rope_params_to_dict", _as_set(original))
    try:
        yield True
    finally:
        setattr(owner, "convert_rope_params_to_dict", original)
