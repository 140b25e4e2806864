"""Stop sequences over streamed pieces, against the whole text cut at the first occurrence of any of them."""

from hypothesis import given
from hypothesis import strategies as st

from cakemp.master.stop_strings import StopStrings

letters = st.text(alphabet="abc", max_size=30)


def shown(pieces, stops):
    """Everything StopStrings lets through for `pieces`, and whether it reached a stop sequence."""
    matcher = StopStrings(stops)
    text = "".join(matcher.feed(piece) for piece in pieces) + matcher.flush()
    return text, matcher.reached


@given(st.lists(letters, max_size=8), st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=4))
def test_the_shown_text_is_the_text_before_the_first_stop_sequence(pieces, stops):
    """However the text is cut into pieces, what is shown is the text up to where the stop sequence that
    ends first begins (a generation halts there: a longer one begun earlier never completes), all of it
    when none occurs."""
    text = "".join(pieces)
    ends = [end for end in range(1, len(text) + 1) if any(text[:end].endswith(s) for s in stops)]
    if not ends:
        assert shown(pieces, stops) == (text, False)
        return
    first = min(ends[0] - len(s) for s in stops if text[:ends[0]].endswith(s))
    assert shown(pieces, stops) == (text[:first], True)


def test_a_possible_beginning_is_held_back_until_the_next_piece_decides():
    matcher = StopStrings(["</end>"])
    assert matcher.feed("hello </e") == "hello "
    assert matcher.feed("xtra") == "</extra"
    assert matcher.feed(" and </en") == " and "
    assert matcher.feed("d> more") == ""
    assert matcher.reached and matcher.feed("after") == "" and matcher.flush() == ""


def test_no_stop_sequences_show_every_piece_as_it_comes():
    matcher = StopStrings([])
    assert [matcher.feed(p) for p in ("a", "b")] == ["a", "b"] and not matcher.reached
