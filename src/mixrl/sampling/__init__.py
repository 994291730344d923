"""Sampling engines: token ids in, token ids and behaviour log-probs out.

Layout: ``base`` (the Engine interface), ``batching`` (the async replica over any
engine), ``profiles`` (number-format profiles), ``factory`` (profile -> engine); one
sub-package per engine: ``builtin/`` (torch, emulated formats) and
``vllm/`` (vLLM, optional dependency).
"""
