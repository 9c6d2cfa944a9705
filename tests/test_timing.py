"""`colossal_lab.timing` helpers that need no GPU."""

from colossal_lab.timing import in_turns


def test_in_turns_rotates_one_place_a_round():
    assert list(in_turns("abc", 4)) == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert list(in_turns([], 2)) == [[], []]
