"""Every spelling of speculative decoding becomes one SpeculativeConfig; every contradiction is
refused with a message that says what to change."""

import argparse

import pytest

from ember.config import EngineConfig
from ember.config.engine_args import add_engine_args, engine_config_from_args
from ember.config.speculative import SpeculativeConfig
from ember.errors import ConfigError


def spec(**kw) -> SpeculativeConfig | None:
    return EngineConfig(**{"model": "m", **kw}).speculative  # a model given: the default model's MTP head stays out


def test_off_by_default():
    assert spec() is None
    assert spec(adaptive_spec=False) is None


def test_all_spellings_of_ngram_agree():
    want = SpeculativeConfig("ngram", 3, None, 5, 5, 1, True)  # vLLM's lookup defaults: 5 and 5
    assert spec(speculative_config={"method": "ngram", "num_speculative_tokens": 3}) == want
    assert spec(speculative_config='{"method": "[ngram]", "num_speculative_tokens": 3}') == want
    assert spec(speculative_config={"model": "[ngram]", "num_speculative_tokens": 3}) == want
    assert spec(speculative_model="ngram", num_speculative_tokens=3) == want
    assert spec(speculative_model="[ngram]", num_speculative_tokens=3, speculative_draft_tensor_parallel_size=1) == want
    # A flag that agrees with the JSON is fine.
    assert spec(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, num_speculative_tokens=3) == want


def test_lookup_bounds_fill_each_other_and_adaptive_follows_the_flag():
    s = spec(
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}, adaptive_spec=False
    )
    assert (s.prompt_lookup_min, s.prompt_lookup_max, s.adaptive) == (4, 4, False)
    s = spec(speculative_config={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2})
    assert (s.prompt_lookup_min, s.prompt_lookup_max, s.num_speculative_tokens) == (2, 2, 8)


def test_cli_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config_from_args(
        parser.parse_args(
            [
                "m",
                "--speculative-model",
                "ngram",
                "--num-speculative-tokens",
                "3",
                "--no-adaptive-spec",
                "--speculative-draft-tensor-parallel-size",
                "1",
            ]
        )
    )
    assert cfg.speculative == SpeculativeConfig("ngram", 3, None, 5, 5, 1, False)
    cfg = engine_config_from_args(
        parser.parse_args(
            [
                "m",
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}',
            ]
        )
    )
    assert cfg.speculative == SpeculativeConfig("ngram", 2, None, 1, 3, 1, True)
    cfg = engine_config_from_args(parser.parse_args(["m", "--enable-mtp"]))
    assert cfg.speculative == SpeculativeConfig("mtp", None, None, None, None, 1, True)  # k = its layers, at load
    cfg = engine_config_from_args(
        parser.parse_args(["m", "--speculative-model", "dir", "--enable-mtp", "--num-speculative-tokens", "2"])
    )
    assert cfg.speculative == SpeculativeConfig("mtp", 2, "dir", None, None, 1, True)


ERRORS = [
    (dict(speculative_config="{method: ngram}"), "--speculative-config is not valid JSON"),
    (dict(speculative_config="[1, 2]"), "must be a JSON object, not list"),
    (
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}),
        r"keys \['lookahead'\] are not known; ember reads method, num_speculative_tokens",
    ),
    (
        dict(speculative_config={"method": "eagle3", "num_speculative_tokens": 2}),
        "'eagle3' is not one of ngram, mtp, draft",
    ),
    (dict(speculative_config={"method": 3}), "must be a string"),
    (dict(speculative_model="ngram", enable_mtp=True, num_speculative_tokens=2), "two drafters; drop one"),
    (
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, num_speculative_tokens=2),
        "says num_speculative_tokens=3 but --num-speculative-tokens says 2",
    ),
    (
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, enable_mtp=True),
        "says method='ngram' but --enable-mtp says 'mtp'",
    ),
    (
        dict(speculative_config={"method": "draft", "model": "a", "num_speculative_tokens": 3}, speculative_model="b"),
        "says model='a' but --speculative-model says 'b'",
    ),
    (
        dict(speculative_config={"method": "mtp", "model": "[ngram]"}),
        "speculative model 'ngram' contradicts method 'mtp'",
    ),
    (dict(num_speculative_tokens=3), "without a drafter; add --speculative-model ngram|DIR, --enable-mtp"),
    (dict(speculative_draft_tensor_parallel_size=1), "without a drafter"),
    (dict(speculative_model="ngram"), r"needs the number of draft tokens; add --num-speculative-tokens k \(1..8\)"),
    (dict(speculative_model="ngram", num_speculative_tokens=9), r"must be an integer in 1..8 \(got 9\)"),
    (dict(speculative_model="ngram", num_speculative_tokens=0), r"must be an integer in 1..8 \(got 0\)"),
    (
        dict(speculative_config={"method": "ngram", "model": "dir", "num_speculative_tokens": 2}),
        "the ngram method has no model",
    ),
    (
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}),
        r"prompt_lookup_min must be an integer >= 1 \(got 0\)",
    ),
    (
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}),
        r"prompt_lookup_max must be an integer >= 1 \(got -1\)",
    ),
    (
        dict(
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 2,
                "prompt_lookup_max": "4",
            }
        ),
        "prompt_lookup_max must be an integer",
    ),
    (
        dict(
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            }
        ),
        "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
    ),
    (
        dict(speculative_config={"method": "mtp", "prompt_lookup_max": 2}),
        "prompt_lookup_min/max are for the ngram method",
    ),
    (
        dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 2}),
        "the draft method needs a draft model; add --speculative-model DIR",
    ),
    (
        dict(speculative_model="ngram", num_speculative_tokens=2, speculative_draft_tensor_parallel_size=2),
        r"must be 1 or the --tensor-parallel-size \(1\) \(got 2\)",
    ),
    (dict(speculative_model="/some/draft", num_speculative_tokens=2), "draft model '/some/draft' not found; give "),
    (
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}),
        r"disable_by_batch_size must be an integer >= 2 \(got 1\)",
    ),
]


@pytest.mark.parametrize("knobs,message", ERRORS, ids=[m[:40] for _, m in ERRORS])
def test_refused_with_a_message(knobs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{"model": "m", **knobs})
