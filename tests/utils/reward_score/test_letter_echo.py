import pytest

from verl.utils.reward_score import letter_echo


@pytest.mark.parametrize(
    "response,score",
    [
        ("aaaa", 1.0),
        ("aaaab", 1.0),
        ("abaa", 0.75),
        ("bbbb", 0.0),
        ("a", 0.25),
        ("", 0.0),
        ("aa<|im_end|>aa", 0.5),
        ("Aaaa", 0.75),
    ],
)
def test_score(response, score):
    assert letter_echo.compute_score(response, "a") == score


@pytest.mark.parametrize("bad", ["", "ab", None, 3])
def test_ground_truth_must_be_one_char(bad):
    with pytest.raises(ValueError, match="single character"):
        letter_echo.compute_score("aaaa", bad)
