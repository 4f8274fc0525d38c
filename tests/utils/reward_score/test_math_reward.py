import pytest

from verl.utils.reward_score import math_reward as m


def test_last_boxed_handles_nesting_and_fbox():
    assert m.last_boxed_only_string(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == r"\boxed{\frac{1}{2}}"
    assert m.last_boxed_only_string(r"x \fbox{7} y") == r"\fbox{7}"
    assert m.last_boxed_only_string(r"$\boxed 5$ done") == r"\boxed 5"
    assert m.last_boxed_only_string(r"\boxed{unclosed") is None
    assert m.last_boxed_only_string("nothing") is None


def test_remove_boxed():
    assert m.remove_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert m.remove_boxed(r"\fbox{7}") == "7"
    assert m.remove_boxed(r"\boxed 5") == "5"
    with pytest.raises(ValueError, match="not a"):
        m.remove_boxed("7")


@pytest.mark.parametrize(
    "a,b",
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\frac1{72}", r"\frac{1}{72}"),
        ("1/2", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        (".5", r"\frac{1}{2}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"90^\circ", "90"),
        (r"50\%", "50"),
        (r"5 \text{ cm}", "5"),
        ("x = 3", "3"),
        (r"\sqrt3", r"\sqrt{3}"),
        (r"\$10", "10"),
    ],
)
def test_equivalent_spellings(a, b):
    assert m.is_equiv(a, b)


@pytest.mark.parametrize("a,b", [("2", "3"), (r"\frac{1}{3}", r"\frac{1}{2}"), ("x+y=3", "3")])
def test_different_answers(a, b):
    assert not m.is_equiv(a, b)


def test_is_equiv_none():
    assert m.is_equiv(None, None) and not m.is_equiv("1", None)


def test_compute_score():
    assert m.compute_score(r"so \boxed{\dfrac{\sqrt{3}}{2}}.", r"\frac{\sqrt3}{2}") == 1.0
    assert m.compute_score(r"so \boxed{4}", "5") == 0.0
    assert m.compute_score("no box: 5", "5") == 0.0
