"""vLLM's /tokenize, /detokenize, /tokenizer_info, and chat's continue_final_message and echo, against a
live server on the default model; token ids are compared with transformers' own tokenizer of the file."""

from __future__ import annotations

import httpx
import pytest

from ember.default_model import default_model_path
from tests.server.live import MODEL_NAME, start_server

CONVERSATION = [
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Nice to meet you!"},
    {"role": "user", "content": "Can I ask a question?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def live():
    server = start_server(
        default_model_path(), dtype="auto", num_threads=2, kv_cache_memory=0.2, max_model_len=1024, tokenizer_info=True
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hf_tok(default_hf_tokenizer):  # tests/conftest.py: loaded once a session
    return default_hf_tokenizer


def test_tokenize_a_prompt_as_transformers_does(live, hf_tok):
    for special in (False, True):
        prompt = "vllm1 This is a test prompt."
        r = httpx.post(
            live.url + "/tokenize", json={"model": MODEL_NAME, "prompt": prompt, "add_special_tokens": special}
        )
        body = r.json()
        assert r.status_code == 200 and body["tokens"] == hf_tok.encode(prompt, add_special_tokens=special)
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024 and body["token_strs"] is None
    body = httpx.post(live.url + "/tokenize", json={"prompt": "token strs!", "return_token_strs": True}).json()
    assert body["token_strs"] == hf_tok.convert_ids_to_tokens(body["tokens"])


@pytest.mark.parametrize("gen, cont", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_tokenize_chat_as_transformers_renders_it(live, hf_tok, gen, cont, tools):
    conv = CONVERSATION + ([{"role": "assistant", "content": "Sure,"}] if cont else [])
    text = hf_tok.apply_chat_template(
        conv, add_generation_prompt=gen, continue_final_message=cont, tools=tools, tokenize=False
    )
    body = httpx.post(
        live.url + "/tokenize",
        json={"messages": conv, "add_generation_prompt": gen, "continue_final_message": cont, "tools": tools},
    ).json()
    assert body["tokens"] == hf_tok.encode(text, add_special_tokens=False)


def test_a_custom_role_renders_through_the_template(live, hf_tok):
    """vLLM passes any role to the chat template; text content and a list of text parts render alike."""
    conv = [{"role": "my-custom-role", "content": "what is 1+1?"}]
    text = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert "my-custom-role" in text
    for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}]):
        body = httpx.post(
            live.url + "/tokenize", json={"messages": [{"role": "my-custom-role", "content": content}]}
        ).json()
        assert body["tokens"] == hf_tok.encode(text, add_special_tokens=False)


def test_detokenize_and_its_errors(live, hf_tok):
    prompt = "This is a test prompt. vllm1"
    ids = hf_tok.encode(prompt, add_special_tokens=False)
    assert httpx.post(live.url + "/detokenize", json={"model": MODEL_NAME, "tokens": ids}).json() == {"prompt": prompt}
    bad = httpx.post(live.url + "/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and "out of vocabulary" in bad.json()["error"]["message"]
    both = httpx.post(live.url + "/tokenize", json={"prompt": "a", "messages": CONVERSATION})
    assert both.status_code == 400
    wrong = httpx.post(live.url + "/tokenize", json={"model": "nope", "prompt": "a"})
    assert wrong.status_code == 404


def test_tokenizer_info(live):
    info = httpx.get(live.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == "<|im_end|>" and info["model_max_length"] >= 1024
    assert "im_start" in info["chat_template"] and isinstance(info["added_tokens_decoder"], dict)


def test_chat_continues_the_final_message_and_echoes_it(live):
    saying = "Here is a common saying about apple. An apple a day, keeps"
    client = live.client()
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}]
    for echo in (True, False):
        r = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False},
        )
        content = r.choices[0].message.content
        assert (saying in content) == echo and content.strip()
        if echo:
            assert content.startswith(saying)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).startswith(saying)
