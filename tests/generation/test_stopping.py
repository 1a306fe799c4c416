"""Stop sequences on the decoded text stream (OpenAI ``stop`` semantics), whatever the tokenisation."""

from __future__ import annotations

import pytest

from foundation.errors import InvalidInput
from generation.stopping import StopMatcher, normalize_stop


def run(deltas: list[str], stops: list[str]) -> tuple[list[str], str, str | None]:
    """Released piece per delta (plus the final flush), the answer, the matched stop."""
    m = StopMatcher(stops)
    pieces = []
    for d in deltas:
        out, stopped = m.feed(d)
        pieces.append(out)
        if stopped:
            break
    pieces.append(m.flush())
    return pieces, m.released, m.matched


def test_text_ends_before_the_first_stop_and_the_stop_is_not_returned() -> None:
    _, text, matched = run(["First", " step", ". Second", " step."], ["."])
    assert (text, matched) == ("First step", ".")


def test_a_stop_split_across_deltas_is_found_and_never_partly_released() -> None:
    pieces, text, matched = run(["Rotate", " logs\n", "\nThen", " more"], ["\n\n"])
    assert (text, matched) == ("Rotate logs", "\n\n")
    assert pieces[1] == " logs"  # the lone "\n" was held back until it turned out to be a stop


def test_a_held_back_prefix_that_is_not_a_stop_is_released_with_the_next_delta() -> None:
    pieces, text, matched = run(["a\n", "b", "c"], ["\n\n"])
    assert pieces[:2] == ["a", "\nb"] and (text, matched) == ("a\nbc", None)


def test_earliest_occurrence_wins_among_several_stops() -> None:
    assert run(["x END y. z"], [".", "END"])[1:] == ("x ", "END")


def test_a_stop_inside_one_token_cuts_inside_it() -> None:
    assert run(["Done.", "More"], ["e."])[1:] == ("Don", "e.")


def test_without_stops_every_delta_passes_unchanged() -> None:
    pieces, text, matched = run(["a", "", "b\n"], [])
    assert pieces == ["a", "", "b\n", ""] and (text, matched) == ("ab\n", None)


def test_end_of_stream_releases_a_held_prefix() -> None:
    assert run(["abc E"], ["END"])[1:] == ("abc E", None)


def test_nothing_is_released_after_a_stop() -> None:
    m = StopMatcher(["."])
    assert m.feed("a.b") == ("a", True) and m.feed("c") == ("", True) and m.flush() == ""


@pytest.mark.parametrize(("stop", "expected"), [(None, []), (".", ["."]), (["a", "bc"], ["a", "bc"])])
def test_stop_is_a_string_or_a_list(stop, expected) -> None:
    assert normalize_stop(stop) == expected


@pytest.mark.parametrize("stop", [["a", "b", "c", "d", "e"], [""], ["x" * 257], [1]])
def test_bad_stop_values_are_refused_naming_the_field(stop) -> None:
    with pytest.raises(InvalidInput) as err:
        normalize_stop(stop)
    assert err.value.code == "invalid_stop" and err.value.details["field"] == "stop"
