"""`ember serve | generate | chat | compile | bench | plan | quantize | train-mtp`."""

from __future__ import annotations

import argparse
import logging
import sys

from ember.config.engine_args import add_engine_args, engine_config_from_args
from ember.errors import EmberError


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(args):
    from ember.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
    )


def _stream(engine, request_id: str, prompt, params, out=None) -> str:
    """Add one request, print its text as it is generated, return the whole text."""
    out = out or sys.stdout
    engine.add_request(request_id, prompt, params)
    req = engine.parents[request_id].children[0]
    try:
        while engine.has_unfinished_requests():
            engine.step()
            delta = req.detokenizer.get_delta(req.is_finished)
            if delta:
                out.write(delta)
                out.flush()
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    out.write("\n")
    return req.detokenizer.output_text


def cmd_generate(args) -> None:
    from ember.engine.engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    _stream(engine, "generate", args.prompt, _sampling_params(args))


def cmd_chat(args) -> None:
    from ember.engine.engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    params = _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("ember chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = engine.parts.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        try:
            reply = _stream(engine, f"chat-{turn}", {"prompt_token_ids": ids}, params)
        except EmberError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
        turn += 1


def cmd_serve(args) -> None:
    from ember.entrypoints.serve import run_server

    run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="a compact, fast LLM inference engine")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    from ember.server.launcher import add_server_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default http://127.0.0.1:8000/v1)")
    add_server_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("prompt")
    add_engine_args(p, positional_model=False)
    _add_sampling_args(p, max_tokens=64)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat (streams; prefix cache reuses earlier turns)")
    add_engine_args(p)
    _add_sampling_args(p, max_tokens=256)
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=cmd_chat)

    from ember.entrypoints.compile import add_compile_parser

    add_compile_parser(sub)
    from ember.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from ember.entrypoints.plan import add_plan_parser
    from ember.entrypoints.quantize import add_quantize_parser
    from ember.entrypoints.train_mtp import add_train_mtp_parser

    add_quantize_parser(sub)
    add_plan_parser(sub)
    add_train_mtp_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


def run_command(func, args) -> int:
    """Log setup and the one place a user error becomes a message and exit code 2 (no traceback)."""
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        func(args)
    except EmberError as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
