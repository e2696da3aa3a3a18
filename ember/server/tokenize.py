"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages through the template),
POST /detokenize, and GET /tokenizer_info (with --enable-tokenizer-info-endpoint, as in vLLM)."""

from __future__ import annotations

from ember.engine.admission import out_of_vocabulary
from ember.errors import ParamError
from ember.server.protocol import DetokenizeRequest, TokenizeRequest
from ember.server.serving import Serving


def _chat_messages(messages) -> list[dict]:
    from ember.server.chat import _message_dict

    return [_message_dict(m) for m in messages]


def tokenize(s: Serving, req: TokenizeRequest) -> dict:
    s.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ParamError("give either prompt or messages", "prompt")
    if req.prompt is not None:
        ids = s.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        text = s.tokenizer.apply_chat_template(
            _chat_messages(req.messages),
            add_generation_prompt=req.add_generation_prompt,
            tokenize=False,
            continue_final_message=req.continue_final_message,
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            chat_template=req.chat_template or s.config.chat_template,
            **(req.chat_template_kwargs or {}),
        )
        ids = s.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    strs = [s.tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(s: Serving, req: DetokenizeRequest) -> dict:
    s.check_model(req.model)
    vocab = s.engine.vocab_size
    if message := out_of_vocabulary("token id", req.tokens, vocab):
        raise ParamError(message, "tokens")
    return {"prompt": s.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(s: Serving) -> dict:
    tok = s.tokenizer
    special = tok.special_tokens
    added = {}
    hf = tok.hf_tokenizer
    for tid, added_token in hf.get_added_tokens_decoder().items():
        added[str(tid)] = {"content": added_token.content, "special": added_token.special}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "vocab_size": tok.vocab_size,
        "model_max_length": s.max_model_len,
        "add_bos_token": bool(tok.add_bos_token),
        "bos_token": special.get("bos_token"),
        "eos_token": special.get("eos_token"),
        "pad_token": special.get("pad_token"),
        "unk_token": special.get("unk_token"),
        "eos_token_ids": list(tok.eos_token_ids),
        "chat_template": s.config.chat_template or tok.chat_template,
        "added_tokens_decoder": added,
    }
