"""The vLLM engine: a mixrl Engine over vllm.LLM (optional dependency)."""
