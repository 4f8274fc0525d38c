"""Reward for the built-in ``letter_echo`` demo task: repeat the target character four times.

Dense on purpose (a quarter point per matching position) so a tiny model learns it in a few PPO steps.
"""

from __future__ import annotations

_WINDOW = 4
_END_OF_TURN = "<|im_end|>"


def compute_score(solution_str: str, ground_truth: str) -> float:
    """Fraction of the first four response characters (before any end-of-turn marker) equal to ``ground_truth``."""
    if not isinstance(ground_truth, str) or len(ground_truth) != 1:
        raise ValueError(
            f"letter_echo.compute_score: ground_truth must be a single character, got {ground_truth!r}; "
            "check reward_model.ground_truth in the letter_echo data"
        )
    head = str(solution_str).split(_END_OF_TURN, 1)[0][:_WINDOW]
    return sum(ch == ground_truth for ch in head) / _WINDOW
