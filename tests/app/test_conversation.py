"""A conversation before the question: the turns the prompt shows and the retrieval query."""

from __future__ import annotations

import pytest

from app.prompting.conversation import QUERY_USER_MESSAGES, Turn, prompt_turns, retrieval_query
from foundation.errors import InvalidInput


def test_system_and_developer_messages_open_the_first_user_turn() -> None:
    turns = prompt_turns([Turn("system", "Be brief."), Turn("user", "Hi"), Turn("developer", "Cite."),
                          Turn("assistant", "Hello")])
    assert turns == [Turn("user", "Be brief.\n\nCite.\n\nHi"), Turn("assistant", "Hello")]


def test_consecutive_messages_of_one_role_are_merged_so_turns_alternate() -> None:
    turns = prompt_turns([Turn("user", "a"), Turn("user", "b"), Turn("assistant", "c"),
                          Turn("assistant", "d"), Turn("user", "e")])
    assert turns == [Turn("user", "a\n\nb"), Turn("assistant", "c\n\nd"), Turn("user", "e")]


def test_an_assistant_message_first_gets_an_empty_user_turn_before_it() -> None:
    assert prompt_turns([Turn("assistant", "Welcome.")]) == [Turn("user", ""), Turn("assistant", "Welcome.")]


def test_no_history_lays_out_nothing() -> None:
    assert prompt_turns([]) == []


@pytest.mark.parametrize("role", ["tool", "function", "System", ""])
def test_unknown_roles_are_refused_with_their_index(role: str) -> None:
    with pytest.raises(InvalidInput) as err:
        prompt_turns([Turn("user", "a"), Turn(role, "x")])
    assert err.value.code == "unsupported_role" and err.value.details["index"] == 1


def test_a_follow_up_query_carries_the_earlier_user_messages_newest_first() -> None:
    history = [Turn("system", "You are on call."), Turn("user", "What does max_wal_senders control?"),
               Turn("assistant", "WAL senders.")]
    assert retrieval_query("And what is its default?", history) == (
        "And what is its default?\nWhat does max_wal_senders control?")


def test_the_query_keeps_at_most_the_last_user_messages_and_never_assistant_text() -> None:
    history = [Turn("user", f"u{i}") for i in range(6)] + [Turn("assistant", "model words")]
    query = retrieval_query("q", history).split("\n")
    assert query == ["q", "u5", "u4"][:QUERY_USER_MESSAGES]
    assert "model words" not in query


def test_a_question_without_history_is_its_own_query() -> None:
    assert retrieval_query("What is VACUUM?", []) == "What is VACUUM?"
