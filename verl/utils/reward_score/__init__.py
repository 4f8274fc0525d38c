"""Rule-based reward functions, chosen by a sample's ``data_source``."""

from __future__ import annotations

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
LETTER_ECHO_SOURCES = ("letter_echo",)


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Score one response with the rule for its data source.

    Returns a float, or the scorer's dict (which holds at least ``"score"``) unchanged.

    Raises:
        NotImplementedError: no built-in rule for ``data_source``.
    """
    del extra_info, kwargs  # accepted so every scorer shares one call signature
    if data_source in GSM8K_SOURCES:
        from . import gsm8k

        result = gsm8k.compute_score(solution_str, ground_truth)
    elif data_source in MATH_SOURCES:
        from . import math_reward

        result = math_reward.compute_score(solution_str, ground_truth)
    elif data_source in LETTER_ECHO_SOURCES:
        from . import letter_echo

        result = letter_echo.compute_score(solution_str, ground_truth)
    else:
        known = GSM8K_SOURCES + MATH_SOURCES + LETTER_ECHO_SOURCES
        raise NotImplementedError(
            f"No built-in reward function for data_source={data_source!r} (built-in: {list(known)}); "
            "write your own compute_score and set custom_reward_function.path / custom_reward_function.name"
        )
    if isinstance(result, dict):
        return result
    if isinstance(result, list | tuple):  # some scorers return (score, details)
        result = result[0]
    return float(result)


def get_default_compute_score(reward_name: str | None = None):
    """The default scorer for a reward manager; every built-in manager uses :func:`default_compute_score`."""
    del reward_name
    return default_compute_score


__all__ = ["default_compute_score", "get_default_compute_score"]
