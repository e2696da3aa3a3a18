"""--generation-config / --override-generation-config (ember.server.sampling_defaults): where the defaults
come from, what is refused at start, and, on a live server, that a request's unset fields take them while
its own values win."""

from __future__ import annotations

import json

import pytest

from ember.errors import ConfigError
from ember.server.sampling_defaults import load_sampling_defaults, parse_override
from tests.server.live import MODEL_NAME, start_server

QWEN35_LIKE = {
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "transformers_version": "5.0.0",
}


def _folder(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_auto_reads_the_model_folders_sampling_fields_and_nothing_else(tmp_path):
    folder = _folder(tmp_path, QWEN35_LIKE)
    assert load_sampling_defaults("auto", folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert load_sampling_defaults("vllm", folder) == {}
    assert load_sampling_defaults("auto", str(tmp_path / "model.gguf")) == {}  # a GGUF file has no such file
    assert load_sampling_defaults("auto", str(tmp_path / "elsewhere")) == {}
    assert load_sampling_defaults("auto", str(tmp_path.parent)) == {}  # a folder without the file


def test_a_named_folder_and_the_override(tmp_path):
    folder = _folder(tmp_path, {"temperature": 0.7, "max_new_tokens": 256})
    assert load_sampling_defaults(folder, "/model/is/not/read") == {"temperature": 0.7, "max_new_tokens": 256}
    override = parse_override('{"temperature": 0, "min_p": 0.05}')
    assert load_sampling_defaults(folder, "", override) == {"temperature": 0, "min_p": 0.05, "max_new_tokens": 256}
    assert parse_override(None) is None and parse_override("") is None


@pytest.mark.parametrize(
    "text, words",
    [
        ("temperature=0", "must be a JSON object"),
        ("[0]", "must be a JSON object"),
        ('{"seed": 1}', "'seed' is not a sampling default ember applies; use temperature, top_p"),
        ('{"top_p": 3}', "top_p"),
        ('{"temperature": -1}', "temperature"),
        ('{"max_new_tokens": 0}', "max_new_tokens must be a positive integer"),
    ],
)
def test_a_bad_override_is_refused_with_what_to_change(text, words):
    with pytest.raises(ConfigError) as e:
        parse_override(text)
    assert "--override-generation-config" in str(e.value) and words in str(e.value)


def test_a_bad_source_is_refused_with_what_to_change(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_sampling_defaults(str(tmp_path), "")
    assert "no generation_config.json there" in str(e.value) and "auto" in str(e.value)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        load_sampling_defaults("auto", str(tmp_path))
    assert "not readable as JSON" in str(e.value) and "--generation-config vllm" in str(e.value)
    (tmp_path / "generation_config.json").write_text('{"top_p": 7}')
    with pytest.raises(ConfigError) as e:
        load_sampling_defaults("auto", str(tmp_path))
    assert "--generation-config auto" in str(e.value) and "top_p" in str(e.value)


@pytest.mark.engine
def test_unset_fields_take_the_defaults_and_a_requests_own_values_win(tiny_qwen3):
    live = start_server(tiny_qwen3, server_knobs={"sampling_defaults": {"temperature": 0, "max_new_tokens": 6}})
    try:
        client = live.client()
        ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Count to ten."}])
        plain = [client.chat.completions.create(**ask) for _ in range(2)]
        greedy = client.chat.completions.create(**ask, temperature=0, max_tokens=6)
        texts = {r.choices[0].message.content for r in plain}
        assert texts == {greedy.choices[0].message.content}  # temperature 0 unless the request says otherwise
        assert [r.usage.completion_tokens for r in plain] == [6, 6] and plain[0].choices[0].finish_reason == "length"
        own = client.chat.completions.create(**ask, max_tokens=9, temperature=1.0, seed=3)
        assert own.usage.completion_tokens == 9
        sampled = {client.chat.completions.create(**ask, temperature=2.0).choices[0].message.content for _ in range(4)}
        assert len(sampled) > 1  # the request's temperature, not the default's 0
    finally:
        live.stop()
