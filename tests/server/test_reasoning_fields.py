"""Reasoning under both of vLLM's names: an assistant turn sent back with `reasoning` or
`reasoning_content` reaches the chat template as reasoning_content (through the request model and the
chat path's message dict); answers carry both names (the whole message and every streamed delta)."""

from __future__ import annotations

import pytest
import tokenizers

from ember.loader.tokenizer import Tokenizer
from ember.server.chat import _message_dict, _StreamedChoice, reasoning_fields
from ember.server.protocol import ChatCompletionRequest
from ember.structured.reasoning import ReasoningSplitter

# renders an assistant turn's reasoning the way Qwen3's template does
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"[UNK]": 0, "</s>": 1}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    return Tokenizer(hf, bos_token_id=None, eos_token_ids=[1], chat_template=TEMPLATE)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_either_name_reaches_the_template_as_reasoning_content(tokenizer, field):
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", field: "I add them."},
                {"role": "user", "content": "and 3+3?"},
            ]
        }
    )
    text = tokenizer.apply_chat_template([_message_dict(m) for m in req.messages], add_generation_prompt=False)
    assert text == "<|user|>2+2?\n<|assistant|><think>I add them.</think>4\n<|user|>and 3+3?\n"


def test_answers_carry_both_names():
    assert reasoning_fields("because") == {"reasoning_content": "because", "reasoning": "because"}
    assert reasoning_fields(None) == {"reasoning_content": None, "reasoning": None}
    choice = _StreamedChoice(ReasoningSplitter("qwen3", "<think>\n"), None, include_reasoning=True)
    assert choice.delta("Let me think", None) == (
        {"reasoning_content": "Let me think", "reasoning": "Let me think"},
        None,
    )
    assert choice.delta(".</think>Four.", "stop") == (
        {"reasoning_content": ".", "reasoning": ".", "content": "Four."},
        "stop",
    )
    hidden = _StreamedChoice(ReasoningSplitter("qwen3", "<think>\n"), None, include_reasoning=False)
    assert hidden.delta("quiet</think>loud", "stop") == ({"content": "loud"}, "stop")
