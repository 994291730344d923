"""Sampling engines: token ids in, token ids and behaviour log-probs out.

Layout: ``base`` (the Engine/Sampler interface), ``batching`` (the async batcher over
any engine), ``profiles`` (number-format profiles), ``factory`` (profile -> engine),
``probe``; one sub-package per engine: ``builtin/`` (torch, emulated formats) and
``vllm/`` (vLLM, optional dependency).
"""
