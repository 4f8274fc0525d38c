import pytest

from verl.utils.reward_score import default_compute_score, get_default_compute_score


def test_dispatch_by_source():
    assert default_compute_score("openai/gsm8k", "#### 12", "12") == 1.0
    assert default_compute_score("openai/gsm8k", "12", "12") == 0.0  # strict by default
    for src in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert default_compute_score(src, r"\boxed{\frac12}", r"\frac{1}{2}") == 1.0
    assert default_compute_score("letter_echo", "zzab", "z", extra_info={"index": 0}) == 0.5


def test_returns_float():
    assert type(default_compute_score("openai/gsm8k", "nothing", "1")) is float


def test_unknown_source():
    with pytest.raises(NotImplementedError, match=r"'my/data'.*custom_reward_function.path"):
        default_compute_score("my/data", "x", "y")


def test_get_default_compute_score():
    assert get_default_compute_score("naive") is default_compute_score
