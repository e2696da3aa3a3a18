"""The `ember serve` flags where outside tools look for them.

The conformance harness that runs vLLM's server tests against ember
(../shared/conformance/vllm-openai/shim/ember_args.py) builds its argument filter from
`ember.server.launcher.add_server_args`; the flags themselves live with the command in
ember/entrypoints/serve.py.
"""
from ember.entrypoints.serve import add_server_args

__all__ = ["add_server_args"]
