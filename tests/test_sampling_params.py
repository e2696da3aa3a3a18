import pytest

from ember.errors import InvalidRequestError
from ember.sampling import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.logprobs is None and p.skip_special_tokens
    assert not p.greedy


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(stop=["ab", "abcd"]).max_stop_len == 4


@pytest.mark.parametrize("t, greedy", [(0, True), (0.0, True), (1e-6, True), (1e-4, False), (0.7, False)])
def test_greedy(t, greedy):
    assert SamplingParams(temperature=t).greedy is greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("seed", 1.5),
        ("seed", "42"),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("min_tokens", -1),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [1, 2]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["2"]),
        ("logprobs", -2),
        ("logprobs", 1.5),
        ("ignore_eos", "yes"),
        ("skip_special_tokens", None),
    ],
)
def test_bad_field_names_field_and_value(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert field in msg
    assert repr(value) in msg or field == "stop"


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidRequestError, match="min_tokens.*max_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    assert SamplingParams(min_tokens=10, max_tokens=None).min_tokens == 10


def test_boundaries_accepted():
    SamplingParams(
        temperature=0,
        top_p=1.0,
        top_k=0,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2,
        logprobs=0,
        max_tokens=1,
        seed=-7,
    )
    SamplingParams(logprobs=20, top_p=1e-3, repetition_penalty=1e-3)


def test_replace_validates_and_copies():
    p = SamplingParams(stop=["x"], stop_token_ids=[1], seed=3)
    child = p.replace(seed=4)
    assert child.seed == 4 and child.stop == ["x"]
    child.stop.append("y")
    child.stop_token_ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]
    assert p.clone() == p and p.clone() is not p
    with pytest.raises(InvalidRequestError, match="top_p"):
        p.replace(top_p=2.0)


@pytest.mark.engine
def test_logprobs_minus_one_is_the_vocabulary_and_the_engine_caps_it(tiny_model_dir):
    from ember import LLM

    assert SamplingParams(logprobs=-1).logprobs == -1 and SamplingParams(logprobs=100).logprobs == 100
    kw = dict(dtype="float32", kv_cache_memory=0.01, max_model_len=64, num_threads=1)
    llm = LLM(tiny_model_dir("qwen3"), **kw)
    with pytest.raises(InvalidRequestError, match="--max-logprobs 20"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    wide = LLM(tiny_model_dir("qwen3"), max_logprobs=-1, **kw)
    out = wide.generate([[1, 2, 3]], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) == wide.engine.parts.loaded.model_config.vocab_size
