"""Tokenizer: ids, decoding, streaming and chat templates, checked against transformers on the
default model (SmolLM2-135M-Instruct GGUF)."""

import json

import pytest
import tokenizers

from ember.default_model import default_model_path
from ember.errors import InvalidRequestError, ModelLoadError
from ember.loader.gguf import GGUFCheckpoint
from ember.loader.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces and trailing   ",
    "def f(x):\n    return x ** 2  # square\n",
    "Prices: 12345, 3.14159 and 1,000,000!",
    "héllo wörld 你好 🙂 Привет мир",
    "emoji run 👩‍👩‍👧‍👦🎉🎉 and tabs\tnew\nlines\r\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "inline <|im_end|>special<|endoftext|> tokens",
    "It's we'll they've I'M DON'T",
    "",
]


@pytest.fixture(scope="module")
def model_file():
    return default_model_path()


@pytest.fixture(scope="module")
def tok(model_file):
    return GGUFCheckpoint(model_file).tokenizer()


@pytest.fixture(scope="module")
def hf_tok(model_file, default_hf_tokenizer):  # tests/conftest.py: loaded once a session
    assert model_file == default_model_path()
    return default_hf_tokenizer


@pytest.mark.slow
def test_ids_match_transformers(tok, hf_tok):
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]


def test_special_ids(tok, hf_tok):
    assert tok.bos_token_id == 1 == hf_tok.bos_token_id
    assert tok.eos_token_ids == [2] and tok.eos_token_id == 2 == hf_tok.eos_token_id
    assert tok.vocab_size == 49152
    assert tok.add_bos_token is False
    assert set(hf_tok.all_special_ids) <= tok.all_special_ids
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.special_tokens["eos_token"] == "<|im_end|>"


def test_decode_round_trip(tok, hf_tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(tok, hf_tok):
    conversations = [
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another, with ünïcode 🙂?"},
        ],
        [{"role": "user", "content": "What is the capital of France?"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
            theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert ours == theirs
        ids = tok.apply_chat_template(messages, tokenize=True)
        assert ids == hf_tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        assert ids[0] == tok.bos_token_id  # <|im_start|> written by the template


def test_user_only_chat_gets_default_system_prompt(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_template_environment_matches_hf(tok):
    template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m | tojson }}\n{% endfor %}"
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
        "{{ bos_token }}|{{ eos_token }}|{{ extra }}"
    )
    messages = [{"role": "user", "content": "<b> & ü"}, {"role": "skip", "content": "x"}]
    text = tok.apply_chat_template(messages, chat_template=template, tools=[{"z": 1, "a": 2}], extra="E")
    # No HTML escaping, no key sorting, non-ASCII kept, loop controls work
    assert text == (
        '{"role": "user", "content": "<b> & ü"}\n[\n  {\n    "z": 1,\n    "a": 2\n  }\n]<|im_start|>|<|im_end|>|E'
    )
    # trim_blocks / lstrip_blocks
    assert tok.apply_chat_template([], chat_template="A\n  {% if true %}\nB\n  {% endif %}\nC") == "A\nB\nC"
    # {% generation %} (transformers' assistant-mask tag) renders its body
    assert tok.apply_chat_template([], chat_template="x{% generation %}y{% endgeneration %}z") == "xyz"
    assert len(tok.apply_chat_template([], chat_template="{{ strftime_now('%Y') }}")) == 4


def test_template_errors_are_invalid_request(tok):
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        tok.apply_chat_template([], chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequestError, match="not valid Jinja"):
        tok.apply_chat_template([], chat_template="{% for %}")
    with pytest.raises(InvalidRequestError):  # the sandbox blocks Python internals
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__ }}")


def test_no_chat_template_is_a_clear_error(tok):
    bare = Tokenizer(tok.hf_tokenizer, bos_token_id=1, eos_token_ids=[2], chat_template=None, add_bos_token=False)
    with pytest.raises(InvalidRequestError, match="no chat template.*plain text prompt"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_decode_stream_is_utf8_safe(tok):
    text = "héllo wörld 你好 🙂 👩‍👩‍👧 done"
    ids = tok.encode(text)
    # The text must really split characters across tokens for this test to mean anything
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    stream = tok.decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert all(p is None or "\ufffd" not in p for p in pieces)
    assert "".join(p for p in pieces if p) == tok.decode(ids) == text


def test_decode_stream_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>")
    stream = tok.decode_stream(skip_special_tokens=True)
    assert "".join(filter(None, (stream.step(i) for i in ids))) == tok.decode(ids) == "assistant\nHi there"
    stream = tok.decode_stream(skip_special_tokens=False)
    assert "".join(filter(None, (stream.step(i) for i in ids))) == "<|im_start|>assistant\nHi there<|im_end|>"


def _write_folder(path, tok, tokenizer_config, generation_config=None, extra_files=None):
    path.mkdir()
    tok.hf_tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    for name, text in (extra_files or {}).items():
        (path / name).write_text(text)
    return path


def test_from_folder_round_trip(tok, tmp_path):
    folder = _write_folder(
        tmp_path / "m",
        tok,
        {
            "chat_template": tok.chat_template,
            "bos_token": "<|im_start|>",
            "eos_token": {"content": "<|im_end|>", "special": True, "lstrip": False},
            "add_bos_token": False,
        },
        {"eos_token_id": [0, 2]},
    )
    loaded = Tokenizer.from_folder(folder)
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == tok.decode(tok.encode(text))
    assert loaded.eos_token_ids == [2, 0]  # tokenizer_config's EOS first, then generation_config's
    assert loaded.bos_token_id == 1 and loaded.add_bos_token is False
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_from_folder_bos_named_templates_and_jinja_file(tok, tmp_path):
    folder = _write_folder(
        tmp_path / "m",
        tok,
        {
            "chat_template": [
                {"name": "default", "template": "D{{ messages[0].content }}"},
                {"name": "tool_use", "template": "T"},
            ],
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "add_bos_token": True,
        },
    )
    loaded = Tokenizer.from_folder(folder)
    assert loaded.add_bos_token is True
    assert loaded.encode("hi") == [1] + tok.encode("hi")
    assert loaded.encode("hi", add_special_tokens=False) == tok.encode("hi")
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"
    assert loaded.apply_chat_template([], chat_template="tool_use") == "T"

    (folder / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_folder(folder).apply_chat_template([]) == "J"


def test_from_folder_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_hf_tokenizer_is_a_tokenizers_object(tok):
    assert isinstance(tok.hf_tokenizer, tokenizers.Tokenizer)
