"""ember.server.responses.translate: Responses requests -> the chat request that answers them
(messages, tools, tool_choice, text.format), and the refusals, each naming its field."""

from __future__ import annotations

import json

import pytest

from ember.errors import ParamError
from ember.server.chat import _message_dict
from ember.server.responses.protocol import InputTokensRequest, ResponsesRequest
from ember.server.responses.translate import to_chat

APPLY_PATCH_GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'


def chat_of(**body) -> dict:
    """The chat request for a Responses body, as plain dicts (messages as the template sees them)."""
    chat = to_chat(ResponsesRequest.model_validate(body)).chat
    return {
        "messages": [_message_dict(m) for m in chat.messages],
        "tools": [t.model_dump(exclude_none=True) for t in chat.tools or []],
        "tool_choice": chat.tool_choice,
        "response_format": chat.response_format,
        "max_tokens": chat.max_tokens,
    }


def refusal(**body) -> ParamError:
    with pytest.raises(ParamError) as e:
        to_chat(ResponsesRequest.model_validate(body))
    return e.value


def test_a_string_input_is_one_user_message_after_the_instructions():
    chat = chat_of(input="Hi", instructions="Be brief.", max_output_tokens=7)
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat["max_tokens"] == 7 and chat["tools"] == [] and chat["response_format"] is None


def test_a_tool_round_trip_folds_the_assistant_turn_into_one_message():
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "done"}]},
        {"role": "user", "content": "Thanks"},
    ]
    assert chat_of(input=items, instructions="You are Codex.")["messages"] == [
        {"role": "system", "content": "You are Codex.\n\nUse tools."},  # one leading system message
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {
            "role": "assistant",
            "content": "",  # a turn with only calls: templates concatenate content
            "tool_calls": [
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "done"},
        {"role": "user", "content": "Thanks"},
    ]


def test_reasoning_falls_back_to_its_summary_and_later_system_messages_are_user_text_in_place():
    items = [
        {"role": "user", "content": "a"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}], "encrypted_content": "x"},
        {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},  # nothing readable: no text
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": "late"},
    ]
    assert chat_of(input=items)["messages"] == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "sum"},
        {"role": "user", "content": "late"},  # no template meets a late system message
    ]


def test_function_and_custom_tools_and_hosted_ones_left_out(caplog):
    tools = [
        {"type": "function", "name": "shell", "description": "Run.", "parameters": {"type": "object"}, "strict": False},
        {
            "type": "custom",
            "name": "apply_patch",
            "description": "Edit files.",
            "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
        },
        {"type": "web_search", "external_web_access": False},
        {"type": "local_shell"},
    ]
    with caplog.at_level("INFO", logger="ember.server"):
        translation = to_chat(
            ResponsesRequest(input="x", tools=tools, tool_choice={"type": "custom", "name": "apply_patch"})
        )
    chat = translation.chat
    assert [t.function.name for t in chat.tools] == ["shell", "apply_patch"]
    assert chat.tools[0].function.model_dump(exclude_none=True) == {
        "name": "shell",
        "description": "Run.",
        "parameters": {"type": "object"},
        "strict": False,
    }
    custom = chat.tools[1].function
    assert custom.parameters["properties"]["input"]["type"] == "string" and custom.parameters["required"] == ["input"]
    assert custom.description.startswith("Edit files.") and APPLY_PATCH_GRAMMAR.strip() in custom.description
    assert translation.custom_tools == {"apply_patch"} and translation.tools == tools  # echoed as given
    assert chat.tool_choice == {"type": "function", "function": {"name": "apply_patch"}}
    assert "'web_search' is left out" in caplog.text and "'local_shell' is left out" in caplog.text


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_tool_choice_words_pass_through(choice):
    tools = [{"type": "function", "name": "f"}]
    assert chat_of(input="x", tools=tools, tool_choice=choice)["tool_choice"] == choice


def test_text_format_becomes_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    assert chat_of(input="x", text={"format": fmt})["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }
    assert chat_of(input="x", text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert chat_of(input="x", text={"format": {"type": "text"}, "verbosity": "low"})["response_format"] is None


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"store": True}, "store", "keeps no state"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no state"),
        ({"conversation": "conv_1"}, "conversation", "keeps no state"),
        ({"background": True}, "background", "keeps no state"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "keeps no state"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:..."}]}]},
            "input",
            "input[0].content[0]: content part type 'input_image' is not supported",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input", "input_text part needs its text"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "input[0].call_id"),
        ({"input": [{"type": "local_shell_call"}]}, "input", "'local_shell_call' is not supported"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role"),
        ({"input": []}, "input", "no input"),
        ({"tools": [{"type": "computer"}]}, "tools", "tool type 'computer' is not supported"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0].name"),
        ({"tools": [{"type": "function", "name": "f"}, {"type": "custom", "name": "f"}]}, "tools", "'f'"),
        (
            {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
            "tool_choice",
            "'g'",
        ),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", "allowed_tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs"),
        ({"text": {"format": {"type": "grammar"}}}, "text", "'grammar'"),
    ],
)
def test_refusals_name_their_field(body, param, words):
    e = refusal(**{"input": "x", **body})
    assert e.param == param and words in str(e), str(e)


def test_an_absent_or_false_store_is_stateless_and_fine():
    for store in ({}, {"store": False}):
        assert chat_of(input="x", **store)["messages"] == [{"role": "user", "content": "x"}]


def test_input_tokens_request_translates_without_sampling_fields():
    chat = to_chat(InputTokensRequest(instructions="Hi", tools=[{"type": "function", "name": "f"}])).chat
    assert [m.role for m in chat.messages] == ["system"] and chat.max_tokens is None
    with pytest.raises(ParamError, match="no input"):
        to_chat(InputTokensRequest())


def test_custom_tool_arguments_are_the_json_the_template_renders():
    items = [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": 'a "quoted"\nline'}]
    chat = to_chat(ResponsesRequest(input=items)).chat
    args = chat.messages[0].tool_calls[0]["function"]["arguments"]
    assert json.loads(args) == {"input": 'a "quoted"\nline'}
