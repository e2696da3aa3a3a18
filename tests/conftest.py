"""Shared fixtures: tiny random HF models saved as model folders (with a tiny tokenizer), built offline."""

from __future__ import annotations

import json
import os

import pytest

# --executor auto on CPU compiles decode graphs on a background thread (ember.engine.executor.background_compile).
# The suite starts hundreds of short-lived engines: there auto stays eager, and the tests of the background
# compile (tests/engine/test_background_compile.py) turn it on. Set here, so servers the tests launch inherit it.
os.environ.setdefault("EMBER_AUTO_COMPILE", "0")


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (`make test`: -n 2), give each worker cores of its own. Unpinned, each
    worker's torch (and every engine or server it starts) takes a thread per core, so two workers
    run 2x the threads the cores hold, and OpenMP's spinning barriers turn that into waits of 2-4x
    on tests that happen to overlap. Pinned, ember's thread count follows the affinity mask
    (ember.platform.usable_cores), in this process and in the servers and workers it starts.
    A machine with fewer cores than workers is left as it is."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit() or not hasattr(os, "sched_setaffinity"):
        return
    cores, workers = sorted(os.sched_getaffinity(0)), int(count)
    if len(cores) < workers:
        return
    share, index = len(cores) // workers, int(worker[2:])
    os.sched_setaffinity(0, cores[index * share : (index + 1) * share])
    import torch

    torch.set_num_threads(share)


_ALL_CORES = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
_pin_xdist_worker()


@pytest.fixture(autouse=True)
def _all_cores_for_marked(request):
    """A test marked `all_cores` (one that runs a rank per core: tensor parallelism over gloo) gets
    back every core the suite started with, for its own duration."""
    if _ALL_CORES is None or request.node.get_closest_marker("all_cores") is None:
        yield
        return
    import torch

    pinned, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, _ALL_CORES)
    torch.set_num_threads(len(_ALL_CORES))
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
        torch.set_num_threads(threads)


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE trained on CPython's own docs, with ChatML specials and a chat template."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = list(pydoc_data.topics.topics.values())[:200]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}, f)


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory):
    """tiny_hybrid_dir(arch) -> a tiny hybrid Qwen folder (tests/models/tiny_hybrids.py), built once per session."""
    from tests.models.tiny_hybrids import build_hybrid, save_hybrid

    cache: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in cache:
            cache[arch] = save_hybrid(build_hybrid(arch), str(tmp_path_factory.mktemp(f"tiny-{arch}")))
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(arch) -> folder with config.json, model.safetensors, tokenizer files (fp32)."""
    from tests.models.tiny_models import VOCAB, build_hf_model, save_hf_model

    cache: dict[str, str] = {}

    def make(arch: str = "qwen3") -> str:
        if arch not in cache:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            save_hf_model(build_hf_model(arch), path)
            write_tiny_tokenizer(path, VOCAB)
            cache[arch] = path
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def default_hf_model():
    """The default model (ember.default_model: SmolLM2-135M, Q4_1 GGUF) as transformers loads it, float32,
    in eval mode: the reference of tests/loader/test_gguf.py, tests/default_model/test_default_model_generate.py
    and tests/server/test_prompt_logprobs.py. Loading it took ~20 s a file (transformers' GGUF reader);
    once per session (per xdist worker) now. Shared: read it, never change it (callers run it under
    no_grad or inference_mode)."""
    import torch
    import transformers

    from ember.default_model import default_model_path

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def default_hf_tokenizer():
    """The default model's tokenizer as transformers reads it from the GGUF file (~8 s: it converts the
    vocabulary), once per session: the reference of tests/loader/test_tokenizer.py and
    tests/server/test_tokenize.py. Shared: read it, never change it."""
    transformers = pytest.importorskip("transformers")

    from ember.default_model import default_model_path

    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


# -- the fast lane: `pytest -m "not engine"` -------------------------------------------------------
# A test that builds an engine (LLM, LLMEngine, AsyncLLMEngine, make_llm, a live server, a subprocess
# that starts one) is marked `engine` (pyproject.toml registers the marker): with a module-level
# `pytestmark`, a mark on the test, or here, through a fixture that builds one. Whatever builds an
# engine in this process and is not marked fails at teardown (_engine_tests_are_marked), so the lane
# cannot quietly grow one; an engine in a subprocess is the mark's alone.

# fixtures that build an engine or start a server over one: a test using one (through another
# fixture too) is an engine test
ENGINE_FIXTURES = {
    "server",
    "client",  # tests/server/conftest.py
    "live",  # tests/server/test_{prompt_logprobs,structured_outputs,tokenize}.py, tests/bench/test_bench_serve.py
    "strict",
    "flagged",
    "scripted",
    "thinking",  # tests/server: servers with their own flags
    "llm",  # tests/default_model/conftest.py, tests/structured/test_structured_engine.py
    "plain",
    "reference",
    "references",
    "long_ref",
    "tiny_data",  # tests/engine, tests/spec: reference runs
    "one_model_load",  # tests/bench/test_bench_cli.py: the default model's engines for `ember bench`
}
# fixtures that load the default model into transformers (seconds each): their tests are `slow`
SLOW_FIXTURES = {"hf_state", "hf_tok"}  # tests/loader/test_gguf.py, tests/loader/test_tokenizer.py


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if ENGINE_FIXTURES & used:
            item.add_marker(pytest.mark.engine)
        if SLOW_FIXTURES & used:
            item.add_marker(pytest.mark.slow)


_engine_built = {"guarded": False, "by_this_test": False}


def _guard_engine_builds() -> None:
    """LLMEngine.__init__ notes that the running test built an engine (once it is built)."""
    import functools

    from ember.engine.engine import LLMEngine

    init = LLMEngine.__init__

    @functools.wraps(init)
    def noting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _engine_built["by_this_test"] = True

    LLMEngine.__init__ = noting_init
    _engine_built["guarded"] = True


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures are set up: a fixture may build the engine
def pytest_runtest_setup(item):
    _engine_built["by_this_test"] = False
    if item.get_closest_marker("engine") is None and not _engine_built["guarded"]:
        _guard_engine_builds()


@pytest.fixture(autouse=True)
def _engine_tests_are_marked(request):
    yield
    if _engine_built["by_this_test"] and request.node.get_closest_marker("engine") is None:
        pytest.fail(
            f"{request.node.nodeid} builds an engine but is not marked `engine`: give it "
            "@pytest.mark.engine (or its module `pytestmark`), so that `pytest -m 'not engine'` "
            "stays the fast lane",
            pytrace=False,
        )
