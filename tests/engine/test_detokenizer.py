import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream

from ember.engine.detokenizer import IncrementalDetokenizer
from ember.sampling import SamplingParams


class PieceTokenizer:
    """Each id is one fixed piece of text: exact control over token boundaries."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def ids(self, *pieces: str) -> list[int]:
        return [self.pieces.index(p) for p in pieces]

    def decode_stream(self, skip_special_tokens: bool):
        pieces = self.pieces

        class _Stream:
            def step(self, token_id):
                return pieces[token_id]

        return _Stream()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


class HFTokenizer:
    """Adapter giving a tokenizers.Tokenizer the interface the detokenizer expects."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok

    def decode_stream(self, skip_special_tokens: bool):
        tok, ds = self.tok, DecodeStream(skip_special_tokens=skip_special_tokens)

        class _Stream:
            def step(self, token_id):
                return ds.step(tok, token_id)

        return _Stream()

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


PIECES = ["Hel", "lo", " wo", "rld", "ST", "OP", " after", "S", "TAY", "!", "xxSTOPyy", "<eos>"]
TOK = PieceTokenizer(PIECES)


def detok(**kw) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(TOK, SamplingParams(**kw))


def test_plain_text_accumulates():
    d = detok()
    assert d.update(TOK.ids("Hel", "lo")) is None
    assert d.update(TOK.ids(" wo", "rld")) is None
    assert d.output_text == "Hello world"
    assert d.get_delta(finished=False) == "Hello world"
    assert d.get_delta(finished=False) == ""


def test_stop_string_spanning_two_tokens_is_cut():
    d = detok(stop="STOP")
    for piece in ("Hel", "lo", " wo", "rld", "ST"):
        assert d.update(TOK.ids(piece)) is None
    assert d.update(TOK.ids("OP")) == "STOP"
    assert d.output_text == "Hello world"
    assert d.update(TOK.ids(" after")) is None  # finished: later tokens are ignored
    assert d.output_text == "Hello world"


def test_include_stop_str_in_output_keeps_it():
    d = detok(stop=["STOP"], include_stop_str_in_output=True)
    assert d.update(TOK.ids("Hel", "lo", "ST", "OP", " after")) == "STOP"
    assert d.output_text == "HelloSTOP"


def test_stop_inside_one_token_and_earliest_of_several():
    d = detok(stop=["yy", "STOP"])
    assert d.update(TOK.ids("Hel", "xxSTOPyy")) == "STOP"
    assert d.output_text == "Helxx"
    d = detok(stop=["rld", "lo"])
    assert d.update(TOK.ids("Hel", "lo", " wo", "rld")) == "lo"
    assert d.output_text == "Hel"


def _stream(d, ids):
    """Feed one token at a time like the engine; return the deltas and the stop."""
    deltas, stop = [], None
    for i in ids:
        stop = d.update([i])
        if stop is not None:
            break
        deltas.append(d.get_delta(finished=False))
    deltas.append(d.get_delta(finished=True))
    return deltas, stop


@pytest.mark.parametrize("include", [False, True])
def test_deltas_never_show_a_cut_stop_prefix(include):
    d = detok(stop=["STOP", "!!"], include_stop_str_in_output=include)
    ids = TOK.ids("Hel", "lo", "S", "TAY", "ST", "OP", " after")
    deltas, stop = _stream(d, ids)
    assert stop == "STOP"
    final = d.output_text
    assert final == ("HelloSTAYSTOP" if include else "HelloSTAY")
    assert "".join(deltas) == final
    shown = ""
    for delta in deltas:
        shown += delta
        assert final.startswith(shown)  # nothing shown is ever taken back
    # "S" was held back until "TAY" proved it was no stop; "ST" was never shown
    assert deltas[:3] == ["Hel", "lo", ""]
    assert deltas[3] == "STAY"


def test_held_back_text_comes_out_when_finished_without_stop():
    d = detok(stop="STOP")
    d.update(TOK.ids("Hel", "lo", "ST"))
    assert d.get_delta(finished=False) == "Hello"
    assert d.get_delta(finished=True) == "ST"
    assert d.get_delta(finished=True) == ""


def test_no_hold_back_without_stop_strings():
    d = detok()
    d.update(TOK.ids("Hel", "ST"))
    assert d.get_delta(finished=False) == "HelST"


def test_decoded_token_shows_special_tokens():
    d = detok()
    assert d.decoded_token(PIECES.index("<eos>")) == "<eos>"
    assert d.decoded_token(0) == "Hel"


# -- a real byte-level BPE tokenizer ----------------------------------------------------------


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "Hello world, this is a tiny corpus.",
        "The quick brown fox jumps over the lazy dog.",
        "héllo wörld 日本語 🙂 naïve café",
    ] * 3
    tok.train_from_iterator(corpus, trainer)
    return tok


TEXT = "Hello 日本語 café 🙂 world, naïve fox"


def test_multibyte_characters_split_over_tokens_never_show_replacement(bpe):
    ids = bpe.encode(TEXT).ids
    # the test means something only if some character really is split over tokens
    assert any("\ufffd" in bpe.decode([i]) for i in ids)
    d = IncrementalDetokenizer(HFTokenizer(bpe), SamplingParams())
    deltas, stop = _stream(d, ids)
    assert stop is None
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == d.output_text == TEXT


def test_a_sequence_cut_inside_a_character_ends_as_a_full_decode_does(bpe):
    """Bytes still waiting for the rest of their character when the sequence ends become U+FFFD, so the
    final text equals decode(token_ids) (clients check it); before the end they never show."""
    ids = bpe.encode(TEXT).ids
    cut = next(k for k in range(1, len(ids)) if "\ufffd" in bpe.decode(ids[:k]))  # ends inside a character
    d = IncrementalDetokenizer(HFTokenizer(bpe), SamplingParams())
    deltas, _ = _stream(d, ids[:cut])
    assert all("\ufffd" not in x for x in deltas)
    d.finish()
    deltas.append(d.get_delta(True))
    assert "".join(deltas) == d.output_text == bpe.decode(ids[:cut])
    assert d.output_text.endswith("\ufffd")
    whole = IncrementalDetokenizer(HFTokenizer(bpe), SamplingParams())
    _stream(whole, ids)
    whole.finish()  # nothing pending: nothing added
    assert whole.output_text == TEXT


@pytest.mark.parametrize(
    "stop, include, expected",
    [
        ("本語", False, "Hello 日"),
        ("本語", True, "Hello 日本語"),
        (["🙂 w", "zzz"], False, "Hello 日本語 café "),
        ("orld", False, "Hello 日本語 café 🙂 w"),
    ],
)
def test_stop_strings_with_a_real_tokenizer(bpe, stop, include, expected):
    ids = bpe.encode(TEXT).ids + bpe.encode(" trailing text").ids
    d = IncrementalDetokenizer(HFTokenizer(bpe), SamplingParams(stop=stop, include_stop_str_in_output=include))
    deltas, got = _stream(d, ids)
    assert got == (stop if isinstance(stop, str) else stop[0])
    assert d.output_text == expected
    assert "".join(deltas) == expected
    shown = ""
    for delta in deltas:
        shown += delta
        assert expected.startswith(shown) and "\ufffd" not in delta


def test_skip_special_tokens_follows_params(bpe):
    eos = bpe.token_to_id("<eos>")
    ids = bpe.encode("Hello").ids + [eos]
    skip = IncrementalDetokenizer(HFTokenizer(bpe), SamplingParams())
    skip.update(ids)
    keep = IncrementalDetokenizer(HFTokenizer(bpe), SamplingParams(skip_special_tokens=False))
    keep.update(ids)
    assert skip.output_text == "Hello"
    assert keep.output_text == "Hello<eos>"
    assert skip.decoded_token(eos) == "<eos>"
