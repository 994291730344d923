"""A math agent written only against the openai client, with one tool: a calculator.

mixrl trains it unchanged:  mixrl train examples/openai_agent/config.toml
It also runs against any OpenAI-compatible server (`mixrl serve bundled`, vLLM, ...).
"""

import ast
import json
import operator
import re

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calc(expr: str) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("unsupported expression")
    try:
        value = ev(ast.parse(expr, mode="eval").body)
        return str(int(value)) if value == int(value) else f"{value:.4g}"
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError):
        return "error: not an arithmetic expression"


async def run(client, row):
    """One episode: ask, run the tool calls, read the <answer>; the reward is 1.0 if it is right."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            found = re.search(r"<answer>(.*?)</answer>", reply.content or "")
            return 1.0 if found and found.group(1).strip() == row["answer"] else 0.0
        for call in reply.tool_calls:
            expr = json.loads(call.function.arguments).get("expr", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(expr)})
    return 0.0
