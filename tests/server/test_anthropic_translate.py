"""ember.server.anthropic.translate: a Messages request -> the chat completions request that serves it
(no engine: the chat request is compared as JSON, then validated as ChatCompletionRequest)."""

from __future__ import annotations

import pytest

from ember.errors import ParamError
from ember.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from ember.server.anthropic.translate import chat_request_dict, drop_billing_header, to_chat_request

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BILLING = "x-anthropic-billing-header: cc_version=2.1.37.3a3; cc_entrypoint=cli; cch=1f2e3;"

# what Claude Code sends, in small: billing header, cache_control marks, metadata, a server tool, a
# thinking block and a tool round trip with an error result
CLAUDE_CODE_TURN = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 32000,
    "stream": True,
    "metadata": {"user_id": "user_abc"},
    "system": [
        {"type": "text", "text": BILLING},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather in Paris?", "cache_control": {"type": "ephemeral"}}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "c2ln"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Lyon"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout", "is_error": True},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ],
    "tools": [
        {"name": "get_weather", "description": "Weather now", "input_schema": SCHEMA, "cache_control": {"type": "x"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    ],
    "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    "thinking": {"type": "enabled", "budget_tokens": 2048},
    "stop_sequences": ["END"],
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 40,
}


def _chat(body: dict) -> dict:
    return chat_request_dict(MessagesRequest.model_validate(body))


def _minimal(**kw) -> dict:
    return {"model": "claude-haiku-4-5", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_a_claude_code_turn_becomes_this_chat_request():
    assert _chat(CLAUDE_CODE_TURN) == {
        "messages": [
            {"role": "system", "content": "You are Claude Code."},  # the billing header is gone
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "reasoning_content": "Use the tool.",
                "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "chat_template_kwargs": {"enable_thinking": True},
        "include_reasoning": True,
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, "description": "Weather now"}}
        ],  # the server tool is left out
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "max_tokens": 32000,
        "stop": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
    }  # fmt: skip
    chat = to_chat_request(MessagesRequest.model_validate(CLAUDE_CODE_TURN))
    assert chat.model is None and chat.stream is False  # the served model; the handler streams itself
    assert chat.messages[2].tool_calls[1]["function"]["arguments"] == '{"city": "Lyon"}'


@pytest.mark.parametrize(
    "choice, chat",
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        ({"type": "auto", "disable_parallel_tool_use": True}, {"tool_choice": "auto", "parallel_tool_calls": False}),
        ({"type": "tool", "name": "f"}, {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ],
)
def test_tool_choice(choice, chat):
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    got = _chat(_minimal(tools=tools, tool_choice=choice))
    assert {k: got[k] for k in chat} == chat and ("parallel_tool_calls" in got) == ("parallel_tool_calls" in chat)


def test_tool_choice_tool_needs_a_name():
    with pytest.raises(ParamError, match="needs the tool's name"):
        _chat(_minimal(tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "tool"}))


@pytest.mark.parametrize(
    "thinking, enabled",
    [
        (None, False),
        ({"type": "disabled"}, False),
        ({"type": "enabled", "budget_tokens": 1024}, True),
        ({"type": "adaptive"}, True),
        ({"type": "between_tools"}, True),
    ],
)
def test_thinking_sets_the_template_switch_and_whether_reasoning_comes_back(thinking, enabled):
    got = _chat(_minimal(**({"thinking": thinking} if thinking else {})))
    assert got["chat_template_kwargs"] == {"enable_thinking": enabled} and got["include_reasoning"] is enabled


def test_output_config_format_is_a_json_schema_response_format():
    got = _chat(_minimal(output_config={"format": {"type": "json_schema", "schema": SCHEMA}, "effort": "low"}))
    assert got["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA}}
    assert (
        to_chat_request(MessagesRequest.model_validate(_minimal(output_config={"effort": "high"}))).response_format
        is None
    )
    with pytest.raises(ParamError, match="output_config.format of type 'xml' is not supported") as e:
        _chat(_minimal(output_config={"format": {"type": "xml"}}))
    assert e.value.param == "output_config"


def test_plain_strings_and_no_optional_fields():
    assert _chat(_minimal(system="Be brief.")) == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False},
        "include_reasoning": False,
        "max_tokens": 64,
    }


def test_a_last_assistant_turn_is_continued():
    body = _minimal(
        messages=[
            {"role": "user", "content": "Count"},
            {"role": "assistant", "content": [{"type": "text", "text": "1, 2,"}]},
        ]
    )
    got = _chat(body)
    assert got["messages"][-1] == {"role": "assistant", "content": "1, 2,"}
    assert got["add_generation_prompt"] is False and got["continue_final_message"] is True


def test_a_mid_conversation_system_message_is_user_text_in_place():
    """Claude Code (2.1.197) sends its reminders as {"role": "system"} after the user's turn: the text stays
    where it is, in that user turn, so no template meets a late system message and the prompt's start
    stays the same from turn to turn."""
    reminder = {"role": "system", "content": "Available agent types: claude, Explore."}
    got = _chat(_minimal(system="You are Claude Code.", messages=[{"role": "user", "content": "hi"}, reminder]))
    assert got["messages"] == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "hi\n\nAvailable agent types: claude, Explore."},
    ]
    assert "continue_final_message" not in got
    # after tool results (no user text to join) it is a user message of its own; text blocks are joined
    blocks = {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]}
    turn = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18C"}]},
        blocks,
    ]
    assert _chat(_minimal(messages=turn))["messages"][-2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "18C"},
        {"role": "user", "content": "Be\nbrief."},
    ]


def test_a_system_message_cleared_at_the_next_user_turn_goes_once_one_comes():
    once = {"role": "system", "content": "Only for this turn.", "clear_at": "next_user_message"}
    kept = {"role": "system", "content": "Always.", "clear_at": "never"}
    first = [{"role": "user", "content": "a"}, once]
    assert _chat(_minimal(messages=first))["messages"] == [{"role": "user", "content": "a\n\nOnly for this turn."}]
    later = [{"role": "user", "content": "a"}, once, {"role": "assistant", "content": "b"}]
    later += [{"role": "user", "content": "c"}, kept]
    assert _chat(_minimal(messages=later))["messages"] == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c\n\nAlways."},
    ]
    with pytest.raises(ParamError) as e:
        tool = {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "w"}}
        _chat(_minimal(messages=[{"role": "user", "content": "a"}, {"role": "system", "content": [tool]}]))
    assert "messages[1].content[0]" in str(e.value) and "'tool_addition' is not supported" in str(e.value)


def test_billing_header_lines_are_dropped_and_nothing_else():
    assert drop_billing_header(BILLING) == ""
    assert drop_billing_header(f"{BILLING}\nYou are Claude Code.\n") == "You are Claude Code.\n"
    kept = "Quote: x-anthropic-billing-header: is a header\n  indented\n"
    assert drop_billing_header(kept) == kept  # only lines that start with it
    got = _chat(_minimal(system=f"{BILLING}\nBe brief."))
    assert got["messages"][0] == {"role": "system", "content": "Be brief."}
    got = _chat(_minimal(system=[{"type": "text", "text": BILLING}]))
    assert got["messages"] == [{"role": "user", "content": "hi"}]  # no empty system message left behind


@pytest.mark.parametrize(
    "content, where, words",
    [
        (
            [
                {"type": "text", "text": "see"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
            ],
            "messages[0].content[1]",
            "'image' block: ember serves text models",
        ),
        ([{"type": "document", "source": {}}], "messages[0].content[0]", "'document' block"),
        (
            [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}],
            "messages[0].content[0].content[0]",
            "'image' block",
        ),
        ([{"type": "server_tool_use", "id": "s"}], "messages[0].content[0]", "'server_tool_use' is not supported"),
        ([{"type": "tool_result", "content": "x"}], "messages[0].content[0].tool_use_id", "is required"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name_and_place(content, where, words):
    with pytest.raises(ParamError) as e:
        _chat(_minimal(messages=[{"role": "user", "content": content}]))
    assert where in str(e.value) and words in str(e.value) and e.value.param == "messages"


def test_count_tokens_request_has_the_same_prompt_without_sampling_fields():
    body = {
        k: v
        for k, v in CLAUDE_CODE_TURN.items()
        if k not in ("max_tokens", "stream", "stop_sequences", "temperature", "top_p", "top_k")
    }
    counted = chat_request_dict(CountTokensRequest.model_validate(body))
    full = _chat(CLAUDE_CODE_TURN)
    assert counted == {
        k: v for k, v in full.items() if k not in ("max_tokens", "stop", "temperature", "top_p", "top_k")
    }
