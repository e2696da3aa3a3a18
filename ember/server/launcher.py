"""The `ember serve` flags: every engine flag (generated from EngineConfig) and the server's own.

The server's flags keep vLLM's names (--host, --port, --api-key, --served-model-name, --chat-template,
--disable-log-requests, --enable-auto-tool-choice, --tool-call-parser, ...), so a vLLM launch line works.
ember/entrypoints/serve.py builds the engine and uvicorn from them; outside tools that need the flag
set read it here too (the harness that runs vLLM's server tests against ember filters vLLM's flags with
`add_server_args`: ../shared/conformance/vllm-openai/shim/ember_args.py).
"""

from __future__ import annotations

import argparse
import json

from ember.config.engine_args import add_engine_args
from ember.engine.async_engine import DEFAULT_MAX_WAITING_REQUESTS
from ember.errors import ConfigError
from ember.server.sampling_defaults import AUTO as AUTO_DEFAULTS
from ember.server.tool_parsers import AUTO, TOOL_PARSERS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_TIMEOUT = 5.0


# vLLM's on/off server flags, with vLLM's meaning (ServerConfig has a field of each name)
VLLM_SWITCHES = {
    "--return-tokens-as-token-ids": "logprobs name tokens `token_id:N` unless a request says otherwise",
    "--enable-force-include-usage": "every streamed answer reports usage on every chunk and at the end",
    "--enable-prompt-tokens-details": "report the prefix-cache hit as usage.prompt_tokens_details.cached_tokens",
    "--enable-request-id-headers": "answer every request with an X-Request-Id header (the client's, or a new one)",
    "--enable-tokenizer-info-endpoint": "serve GET /tokenizer_info (the tokenizer's configuration and chat template)",
}


def add_server_args(parser: argparse.ArgumentParser, *, positional_model: bool = True) -> None:
    add_engine_args(parser, positional_model=positional_model)
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default {DEFAULT_HOST}; 0.0.0.0 exposes the server to the network)",
    )
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    g.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/* (default: $EMBER_API_KEY, or vLLM's $VLLM_API_KEY, "
        "else no key)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients use; the first is reported (default: the model argument)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help=f"requests allowed to wait for a slot; more are answered 503 (default {DEFAULT_MAX_WAITING_REQUESTS})",
    )
    g.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run a short request and a long step (the full budget; 512 tokens on CPU) before /health reports ready (default on)",
    )
    g.add_argument(
        "--chat-template", default=None, help="a Jinja chat template, or a file holding one, instead of the model's"
    )
    g.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    g.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's own log level (info shows one access line per request)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: ember parses tool calls whenever a request has tools",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        metavar="SECONDS",
        help="on SIGTERM / Ctrl-C: stop taking requests (503), give those in flight this long to finish, "
        f"then abort the rest (finish_reason abort); 0 aborts at once (default {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    g.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy serves ember under (e.g. /llm): routes answer with and without it",
    )
    for flag, what in VLLM_SWITCHES.items():
        g.add_argument(flag, action="store_true", help=what + " (vLLM's flag)")
    g.add_argument(
        "--tool-call-parser",
        default=AUTO,
        choices=[AUTO, *TOOL_PARSERS],
        help="how tool calls are read from the model's text (and written when tool_choice forces one): hermes = "
        "<tool_call>{json}</tool_call> (Qwen2.5, Qwen3, Hermes); qwen3_coder or qwen3_xml = <tool_call><function=NAME>"
        "<parameter=P>value</parameter></function></tool_call> (Qwen3.5, Qwen3-Coder); auto (default): the one the "
        "chat template writes, else hermes",
    )
    _add_sampling_default_args(g)
    _add_cors_args(g)


def _add_sampling_default_args(g) -> None:
    """vLLM's --generation-config and --override-generation-config (ember.server.sampling_defaults)."""
    g.add_argument(
        "--generation-config",
        default=AUTO_DEFAULTS,
        metavar="auto|vllm|FOLDER",
        help="default sampling (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) for what a "
        "request leaves unset: auto (default) = the model folder's generation_config.json, as its makers "
        "recommend; vllm = none (temperature 1, no cut-off); a folder = its generation_config.json",
    )
    g.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="sampling defaults over --generation-config's, as a JSON object, e.g. '{\"temperature\": 0}'",
    )


def _add_cors_args(g) -> None:
    """vLLM's CORS flags; JSON lists, read by cors_options."""
    g.add_argument(
        "--allowed-origins",
        default="[]",
        metavar="JSON_LIST",
        help="origins a browser may call the server from, as a JSON list (e.g. '[\"http://localhost:3000\"]', "
        "'[\"*\"]' for any); default [] : no cross-origin access",
    )
    g.add_argument(
        "--allowed-methods",
        default='["*"]',
        metavar="JSON_LIST",
        help='HTTP methods allowed cross-origin, as a JSON list (default ["*"]); used with --allowed-origins',
    )
    g.add_argument(
        "--allowed-headers",
        default='["*"]',
        metavar="JSON_LIST",
        help='request headers allowed cross-origin, as a JSON list (default ["*"]); used with --allowed-origins',
    )
    g.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let cross-origin requests carry cookies and auth headers (default off); used with --allowed-origins",
    )


def cors_options(args: argparse.Namespace) -> dict:
    """ServerConfig's CORS fields from the parsed flags; a flag whose value is not a JSON list of
    strings is a ConfigError naming it."""
    out = {}
    for flag in ("--allowed-origins", "--allowed-methods", "--allowed-headers"):
        name = flag[2:].replace("-", "_")
        text = getattr(args, name)
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} {text!r} is not JSON ({e.msg}); give a JSON list, e.g. '[\"*\"]'") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{flag} {text!r} is not a JSON list of strings; give one, e.g. '[\"*\"]'")
        out[name] = value
    out["allow_credentials"] = args.allow_credentials
    return out
