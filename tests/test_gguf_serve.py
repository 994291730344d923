"""``mixrl serve FILE.gguf``: the openai client, tools, the model's own chat template."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf_model import write_tiny_gguf

openai = pytest.importorskip("openai")
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate an expression",
                                           "parameters": {"type": "object",
                                                          "properties": {"expr": {"type": "string"}}}}}]


def test_serve_a_gguf_file_answers_a_chat_request_with_tools(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    _, path = write_tiny_gguf(tmp_path)
    env = dict(os.environ, MIXRL_GGUF_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "mixrl.commands.main", "serve", str(path), "--port", "0",
                             "--max-tokens", "8"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        url, deadline = None, time.time() + 300
        while url is None and time.time() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"mixrl serve exited with {proc.returncode}")
            m = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line)
            url = m.group(1) if m else None
        assert url is not None
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "What is 12 + 7?"}]
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, user="s1")
        assert r.choices[0].message.role == "assistant" and 1 <= r.usage.completion_tokens <= 8
        # the prompt is the converted model's own template, tools included, token for token
        (hf_dir,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and not p.name.startswith(".")]
        tok = AutoTokenizer.from_pretrained(str(hf_dir))
        want = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert '"name": "calc"' in want and want.startswith("<|im_start|>system\nTools:")
        # the endpoint encodes the template's frame and each message's content apart (contents are
        # untrusted text); the ids decode to the template's rendering exactly
        from mixrl.models.chat import ChatFormat
        from mixrl.serve.conversation import render_ids

        ids = render_ids(ChatFormat(tok), messages, TOOLS)
        assert tok.decode(ids) == want and r.usage.prompt_tokens == len(ids)
        plain = client.chat.completions.create(model="m", messages=messages, user="s2")
        assert plain.usage.prompt_tokens < r.usage.prompt_tokens  # the tools reached the template
    finally:
        proc.terminate()
        proc.wait(timeout=60)
