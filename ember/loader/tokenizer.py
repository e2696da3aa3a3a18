"""The tokenizer: ids <-> text, the special ids generation needs, and the chat template.

It wraps a `tokenizers.Tokenizer` built either from a Hugging Face folder (`from_folder`) or
from a GGUF file's metadata (`ember.loader.gguf`). Chat templates render in a Jinja sandbox set
up the way transformers sets it up, so a template gives the same text here as there.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import processors
from tokenizers.decoders import DecodeStream

from ember.errors import InvalidRequestError, ModelLoadError

# Names templates read special tokens under, as transformers passes them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        chat_template: str | dict[str, str] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool = False,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
    ):
        """`add_bos_token` True/False rewrites the post-processor to add BOS (and EOS if
        `add_eos_token`) or nothing; None keeps the one `hf_tokenizer` came with.
        `chat_template` may be a dict of named templates; "default" is the one used."""
        self._tok = hf_tokenizer
        self.bos_token_id = bos_token_id
        # dict.fromkeys dedupes and keeps the primary EOS first
        self.eos_token_ids = list(dict.fromkeys(int(i) for i in eos_token_ids))
        strings = {"bos_token": bos_token, "eos_token": eos_token, "unk_token": unk_token, "pad_token": pad_token}
        if strings["bos_token"] is None and bos_token_id is not None:
            strings["bos_token"] = hf_tokenizer.id_to_token(bos_token_id)
        if strings["eos_token"] is None and self.eos_token_ids:
            strings["eos_token"] = hf_tokenizer.id_to_token(self.eos_token_ids[0])
        self.special_tokens = {k: v for k, v in strings.items() if v is not None}

        if isinstance(chat_template, dict):
            self.chat_templates = dict(chat_template)
            chat_template = self.chat_templates.get("default")
        else:
            self.chat_templates = {"default": chat_template} if chat_template else {}
        self.chat_template: str | None = chat_template or None

        if add_bos_token is not None:
            self._set_post_processor(add_bos_token, add_eos_token)
        # What encode() actually does, whoever configured it
        probe = hf_tokenizer.encode("", add_special_tokens=True).ids
        self.add_bos_token = bool(probe) and bos_token_id is not None and probe[0] == bos_token_id

    # ---- construction from a folder -------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> Tokenizer:
        """A Hugging Face model folder: tokenizer.json, tokenizer_config.json and optionally
        generation_config.json / config.json (EOS ids) and chat_template.jinja."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ModelLoadError(
                f"{path} has no tokenizer.json; ember needs the fast-tokenizer file that Hugging Face "
                "model folders ship (save one with `AutoTokenizer.from_pretrained(...).save_pretrained(...)`)."
            )
        try:
            hf_tok = tokenizers.Tokenizer.from_file(tok_file)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"{tok_file} cannot be read as a tokenizers file: {e}") from e

        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        strings = {name: _token_content(cfg.get(name)) for name in SPECIAL_TOKEN_NAMES}

        def token_id(s: str | None) -> int | None:
            return None if s is None else hf_tok.token_to_id(s)

        gen = _read_json(os.path.join(path, "generation_config.json"))
        model_cfg = _read_json(os.path.join(path, "config.json"))
        eos_ids = [token_id(strings["eos_token"])]
        # generation_config is what HF generate() stops on; config.json is its fallback
        eos_ids += _as_list(gen.get("eos_token_id", model_cfg.get("eos_token_id")))
        bos_id = token_id(strings["bos_token"])
        if bos_id is None:
            bos_id = gen.get("bos_token_id", model_cfg.get("bos_token_id"))

        return cls(
            hf_tok,
            bos_token_id=bos_id,
            eos_token_ids=[i for i in eos_ids if i is not None],
            chat_template=_folder_chat_template(path, cfg),
            # Only an explicit flag overrides tokenizer.json's post-processor (as in transformers)
            add_bos_token=cfg.get("add_bos_token"),
            add_eos_token=bool(cfg.get("add_eos_token", False)),
            **strings,
        )

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos = self.special_tokens.get("bos_token") if add_bos and self.bos_token_id is not None else None
        eos = self.special_tokens.get("eos_token") if add_eos and self.eos_token_ids else None

        def seq(name: str, type_id: int) -> list[str]:
            # Lists, not one string: a token with a space would break the string form
            return (
                ([f"{bos}:{type_id}"] if bos else []) + [f"${name}:{type_id}"] + ([f"{eos}:{type_id}"] if eos else [])
            )

        specials = ([(bos, self.bos_token_id)] if bos else []) + ([(eos, self.eos_token_ids[0])] if eos else [])
        self._tok.post_processor = processors.TemplateProcessing(
            single=seq("A", 0), pair=seq("A", 0) + seq("B", 1), special_tokens=specials
        )

    # ---- ids <-> text ---------------------------------------------------------------------

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @functools.cached_property
    def all_special_ids(self) -> set[int]:
        ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        ids.update(self.eos_token_ids)
        if self.bos_token_id is not None:
            ids.add(self.bos_token_id)
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode_stream(self, skip_special_tokens: bool = True) -> TextStream:
        """A fresh incremental decoder for one sequence; see TextStream."""
        return TextStream(self._tok, skip_special_tokens)

    # ---- chat -----------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template (or `chat_template`: a template
        string or the name of one of the model's named templates). Extra kwargs reach the
        template as variables (e.g. `enable_thinking=False` for Qwen3). continue_final_message:
        the prompt ends inside the last message (an assistant reply to continue), as transformers
        cuts it: right after that message's text, its end-of-turn left out."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true: the "
                "first continues the last message, the second opens a new one"
            )
        template = self._pick_template(chat_template)
        variables = {**self.special_tokens, **kwargs}
        try:
            text = _compile(template).render(
                messages=[_alias_reasoning(m) for m in messages],
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            # Includes raise_exception() from the template: its message says what is wrong
            raise InvalidRequestError(f"The chat template rejected these messages: {e}") from e
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        if not tokenize:
            return text
        # The template writes BOS itself where the model wants one
        return self.encode(text, add_special_tokens=False)

    def _pick_template(self, chat_template: str | None) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if self.chat_template is None:
            raise InvalidRequestError(
                "This model has no chat template, so chat messages cannot be turned into a prompt. "
                "Use generate with a plain text prompt, or pass a chat template."
            )
        return self.chat_template

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids}, "
            f"add_bos_token={self.add_bos_token}, chat_template={'yes' if self.chat_template else 'no'})"
        )


class TextStream:
    """Incremental detokenization of one sequence: `step(id)` returns the new text, or None
    while the bytes so far end inside a UTF-8 character (so no "\\ufffd" leaks out).

    Backed by tokenizers' DecodeStream, which re-decodes a short window of recent ids so that
    decoders that look at neighbours (byte-level, byte-fallback, prefix-space stripping) give
    the same text as a full decode.
    """

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool = True):
        self._tok = hf_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self._stream.step(self._tok, int(token_id))


# ---- helpers ------------------------------------------------------------------------------


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):  # text parts
        final = "".join(p.get("text", "") for p in final if isinstance(p, dict))
    if not isinstance(final, str) or not final.strip() or final.strip() not in text:
        raise InvalidRequestError(
            "continue_final_message needs a last message with text content that the chat template writes out"
        )
    at = text.rindex(final.strip())
    if text[at : at + len(final.lstrip())] == final.lstrip():
        return text[: at + len(final.lstrip())]
    return text[: at + len(final.strip())]


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); fix or remove the file.") from e


def _token_content(value: object) -> str | None:
    """tokenizer_config writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_list(value: object) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _folder_chat_template(path: str, cfg: dict) -> str | dict[str, str] | None:
    """chat_template.jinja beats chat_template.json beats tokenizer_config.json, as in transformers."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    if template is None:
        template = cfg.get("chat_template")
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        return {t["name"]: t["template"] for t in template}
    return template


# Names a message's reasoning travels under; Qwen3 templates read reasoning_content, gpt-oss thinking.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: object) -> object:
    if not isinstance(message, dict):
        return message
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args, **kwargs):  # same self-less signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"The chat template is not valid Jinja (line {e.lineno}): {e.message}") from e
