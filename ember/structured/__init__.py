"""Structured outputs: a request's answer held to a JSON schema, regex, choice list or grammar.

Grammars are built and compiled by xgrammar (the library vLLM and SGLang use); ember keeps one
matcher per request and masks the step's logits with it (manager.py, masks.py). grammar.py turns
StructuredOutputsParams into a grammar, tool_calls.py turns `tools` + `tool_choice` into one.
"""
