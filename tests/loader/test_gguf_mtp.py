"""The MTP layer of a hybrid Qwen GGUF: llama.cpp's converter (convert_hf_to_gguf.py, llama-cpp-python
0.3.36) keeps a Qwen3.5 / Qwen3-Next folder's mtp.* tensors as blk.N.nextn.* plus one more block past
num_hidden_layers (nextn_predict_layers in the metadata). Such a file serves with or without MTP, and its
MTP layer is the folder's: the same weights, the same drafts."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGUFReader

from ember import SamplingParams
from ember.bench.peers.llamacpp_convert import convert
from ember.errors import ModelLoadError
from tests.loader.test_gguf_hybrid import hf_folder, llm, prompts
from tests.models.tiny_hybrids import add_mtp
from tests.models.tiny_models import hf_greedy, one_thread  # noqa: F401

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]
MTP = {"method": "mtp", "num_speculative_tokens": 2}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def with_mtp(request, tmp_path_factory):
    """(HF model, its folder with a random mtp.* layer, the folder converted to GGUF keeping it)."""
    model, path = hf_folder(str(tmp_path_factory.mktemp("gguf-mtp")), request.param)
    add_mtp(model, path)
    return model, path, convert(path, path + ".f32.gguf", "f32")


def recorded_drafts(engine) -> list[list[int]]:
    """Every draft the proposer hands out from now on, in order."""
    proposer, seen = engine.engine.parts.spec.proposer, []
    propose = proposer.propose

    def record(requests, max_tokens):
        drafts = propose(requests, max_tokens)
        seen.extend(d.token_ids for d in drafts if d is not None)
        return drafts

    proposer.propose = record
    return seen


def test_the_converter_keeps_the_mtp_layer_as_nextn_tensors(with_mtp):
    _, _, gguf = with_mtp
    reader = GGUFReader(gguf)
    arch = reader.fields["general.architecture"].contents()
    assert reader.fields[f"{arch}.nextn_predict_layers"].contents() == 1
    names = {t.name for t in reader.tensors}
    n = reader.fields[f"{arch}.block_count"].contents() - 1  # the MTP block is the last one
    assert {f"blk.{n}.nextn.{p}.weight" for p in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= names
    assert f"blk.{n}.attn_q.weight" in names


def test_mtp_from_the_file_is_the_folders_mtp(with_mtp):
    """Both load the MTP layer (speculation on, fixed k): its weights agree to float32 rounding (the file
    holds zero-centred norms as 1 + w), it drafts the same tokens, and the output is transformers' greedy."""
    hf, folder, gguf = with_mtp
    runs = {}
    for path in (folder, gguf):
        engine = llm(path, speculative_config=MTP, adaptive_spec=False)
        drafts = recorded_drafts(engine)
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
        runs[path] = (
            engine.engine.parts.spec.proposer.mtp.state_dict(),
            drafts,
            [o.outputs[0].token_ids for o in outs],
        )
    (ours, our_drafts, our_tokens), (theirs, their_drafts, their_tokens) = runs[gguf], runs[folder]
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)
    assert len(our_drafts) > 10 and our_drafts == their_drafts
    assert our_tokens == their_tokens == [hf_greedy(hf, p, 12) for p in prompts()]


def test_mtp_asked_of_a_file_converted_without_it_names_the_fix(tmp_path):
    _, path = hf_folder(str(tmp_path), "qwen3_5")
    gguf = convert(path, path + ".gguf", "f32", ("--no-mtp",))
    with pytest.raises(ModelLoadError, match=r"no MTP layer .*--no-mtp"):
        llm(gguf, speculative_config=MTP)
    assert os.path.exists(gguf)
