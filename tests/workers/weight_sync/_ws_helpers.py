"""Tiny Qwen3.5 models for the weight-sync tests (a uniquely named module: test dirs have no __init__)."""

import functools

# vLLM's CPU Gated DeltaNet kernel needs 128-wide key/value heads; use the same shapes here so the
# name/shape rules tested on CPU are the ones the vllm-marked tests exercise.
TINY = dict(hidden_size=128, head_dim=32, linear_key_head_dim=128, linear_value_head_dim=128)


def tiny(kind="dense", seed=0, fresh=False, **kw):
    """A tiny Qwen3.5; cached per (kind, seed) unless ``fresh`` (callers that wrap or train it need fresh)."""
    if fresh or kw:
        from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

        return build_tiny_qwen3_5(None, kind=kind, seed=seed, **{**TINY, **kw})
    return _cached(kind, seed)


@functools.lru_cache(maxsize=None)
def _cached(kind, seed):
    return tiny(kind, seed, fresh=True)
