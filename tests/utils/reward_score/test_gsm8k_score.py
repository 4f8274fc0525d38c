import pytest

from verl.utils.reward_score import gsm8k


@pytest.mark.parametrize(
    "text,strict,flexible",
    [
        ("so the total is 18.\n#### 18", "18", "18"),
        ("#### 1,234", "1234", "1234"),
        ("first #### 3 then #### -5", "-5", "-5"),
        ("the answer is 42.", None, "42"),
        ("#### 72.", "72", "72"),
        ("no digits here", None, None),
    ],
)
def test_extract_solution(text, strict, flexible):
    assert gsm8k.extract_solution(text, "strict") == strict
    assert gsm8k.extract_solution(text, "flexible") == flexible


def test_only_the_tail_is_searched():
    text = "#### 5" + "x" * 400
    assert gsm8k.extract_solution(text, "strict") is None


def test_compute_score_strict_and_flexible():
    assert gsm8k.compute_score("work... #### 18", "18") == 1.0
    assert gsm8k.compute_score("work... #### 17", "18") == 0.0
    assert gsm8k.compute_score("work... #### 17", "18", format_score=0.1) == 0.1
    assert gsm8k.compute_score("it is 18", "18") == 0.0
    assert gsm8k.compute_score("it is 18", "18", method="flexible") == 1.0
    assert gsm8k.compute_score("#### 18.0", "18", score=2.0) == 2.0


def test_bad_method():
    with pytest.raises(ValueError, match="strict"):
        gsm8k.extract_solution("#### 1", "loose")
