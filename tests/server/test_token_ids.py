"""vLLM's return_token_ids (prompt_token_ids and each choice's token_ids) and return_tokens_as_token_ids
(logprobs name tokens `token_id:N`), whole and streamed."""

from __future__ import annotations

from tests.server.live import MODEL_NAME


def test_completion_token_ids(client, server):
    tok = server.engine.parts.loaded.tokenizer
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="hello world",
        max_tokens=6,
        temperature=0,
        logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    c = r.choices[0]
    assert c.prompt_token_ids == tok.encode("hello world")
    assert tok.decode(c.token_ids) == c.text and len(c.token_ids) == 6
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.token_ids]
    off = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=2).model_dump()
    assert "prompt_token_ids" in off["choices"][0] and off["choices"][0]["prompt_token_ids"] is None
    assert off["choices"][0].get("token_ids") is None

    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="hello world",
        max_tokens=6,
        temperature=0,
        stream=True,
        logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    chunks = [ch for ch in stream if ch.choices]
    assert chunks[0].choices[0].prompt_token_ids == c.prompt_token_ids
    streamed = [t for ch in chunks for t in ch.choices[0].token_ids]
    assert streamed == c.token_ids
    assert [s for ch in chunks for s in ch.choices[0].logprobs.tokens] == c.logprobs.tokens


def test_chat_token_ids(client, server):
    tok = server.engine.parts.loaded.tokenizer
    msgs = [{"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert r.prompt_token_ids == prompt
    assert tok.decode(r.choices[0].token_ids, skip_special_tokens=True) == r.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=0, stream=True, extra_body={"return_token_ids": True}
    )
    chunks = list(stream)
    assert chunks[0].prompt_token_ids == prompt
    assert all("prompt_token_ids" not in ch.model_dump() for ch in chunks[1:])
    assert [t for ch in chunks if ch.choices for t in (getattr(ch.choices[0], "token_ids", None) or [])] == r.choices[
        0
    ].token_ids
    off = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=2)
    assert off.prompt_token_ids is None and off.choices[0].token_ids is None


def test_tokens_inside_a_character_are_streamed_with_their_ids(client, server):
    """A token that ends inside a UTF-8 character has no text yet; its id still streams (vLLM's emoji tests)."""
    tok = server.engine.parts.loaded.tokenizer
    text = "🦩🦩"
    pieces = [tok.decode([t]) for t in tok.encode(text)]
    assert any("\ufffd" in p for p in pieces)  # the tokenizer splits the character: the case under test
    kw = dict(
        model=MODEL_NAME,
        prompt="a bird:",
        max_tokens=20,
        temperature=0,
        extra_body={"return_token_ids": True, "structured_outputs": {"choice": [text]}},
    )
    whole = client.completions.create(**kw).choices[0]
    assert whole.text == text and tok.decode(whole.token_ids) == text
    chunks = [ch for ch in client.completions.create(stream=True, **kw) if ch.choices]
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == whole.token_ids
    assert "".join(ch.choices[0].text for ch in chunks) == text
    chat = [
        ch
        for ch in client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "a bird"}],
            max_tokens=20,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True, "structured_outputs": {"choice": [text]}},
        )
        if ch.choices
    ]
    ids = [t for ch in chat for t in (getattr(ch.choices[0], "token_ids", None) or [])]
    assert (
        tok.decode(ids, skip_special_tokens=True) == "".join(ch.choices[0].delta.content or "" for ch in chat) == text
    )
