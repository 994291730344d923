"""Agentic coding episodes (family ``"coding"``): a bash tool in a sandbox, graded by tests.

    user:      <problem statement + how to use the tools>
    assistant: <bash>grep -n "def median" -r .</bash>      # runs in /testbed
    tool:      exit code 0\\n./stats/central.py:10:def median...
    assistant: <bash>python -m pytest -q</bash>
    tool:      ...
    assistant: <submit/>                                   # ends the episode: grading

Rules (the shared ones are in ``envs/turns.py``; call syntax in ``tools.py``):

- the first tool call of a reply is taken; ``bash`` output (stdout and stderr,
  at most ``max_output_chars``, with the exit code and a note when cut or
  killed) comes back as a tool turn;
- ``submit`` ends the episode: the diff of /testbed is graded in a new sandbox
  (``grade.py``): status ``ok`` with reward 1 or 0; ``failed`` with reward 0 when the
  grading ran out of its time limit or filled its filesystem; ``reward_hacked`` with
  reward 0 when the grader saw a forged or ill-formed result (a canary test counted
  passed, a test reported passed without its checks; the patch is kept in
  ``info["patch"]`` for inspection);
- a malformed call gets ``error: <reason>`` as tool output and counts as
  malformed; a reply without any call gets a user reminder; three such
  replies in a row end with ``format_error``, ``max_turns`` replies without a
  submit with ``max_turns`` (reward 0; with ``grade_on_max_turns`` the work
  is graded instead, status still ``max_turns``);
- a command that fills the episode's filesystem (bytes or inodes) ends the
  episode (status ``ok``, reward 0, ``info["reason"] = "disk"``);
- what the model does to its own tree or commands (``chmod 000 /testbed``, a
  200 KB command, a path past PATH_MAX, a diff it makes impossible) is a tool
  result or a reward of 0, never ``infra_failed``; tool output is encoded as
  untrusted text (no special-token id can come from it, ``models/untrusted.py``);
- our failures (no bwrap, a sandbox that does not start, a grading runner
  that does not start) end with ``infra_failed`` and reward ``None``; a
  sandbox that cannot be created at ``reset`` raises, which the session
  runner records as ``infra_failed``.

Resume replays the recorded commands into a fresh sandbox; commands whose
output is not deterministic (timings, random) make the replay differ: the
session then restarts the episode from its prompt (``runtime/sessions.py``,
counted in ``info["resume_restarted"]``), never ``infra_failed``.
"""

from __future__ import annotations

from typing import Any

from mixrl.envs.base import Env, StepResult
from mixrl.envs.coding.grade import GradeResult, grade_sandbox
from mixrl.envs.coding.loader import ensure_hidden
from mixrl.envs.coding.tools import Malformed, parse_tool_call
from mixrl.envs.sandbox import ExecResult, Sandbox, SandboxError, SandboxLimits
from mixrl.envs.turns import TurnTracker
from mixrl.models.chat import ChatFormat
from mixrl.models.untrusted import strip_control
from mixrl.records.task import Task

SYSTEM = (
    "You are fixing a bug in a Python repository at /testbed. Run shell commands with "
    "<bash>COMMAND</bash> (or a JSON call {\"name\": \"bash\", \"arguments\": {\"command\": \"...\"}}); "
    "one command per reply, its output comes back. There is no network. When the fix is done, "
    "reply with <submit/> (or {\"name\": \"submit\", \"arguments\": {}}): hidden tests then grade "
    "the repository."
)
NUDGE = "Use a tool: <bash>COMMAND</bash> to run a command, or <submit/> when the fix is done."


def format_result(res: ExecResult, max_chars: int) -> str:
    """The tool turn's text for one command."""
    out = res.output
    notes = []
    if len(out) > max_chars:
        out = out[:max_chars]
        notes.append("output truncated")
    elif res.truncated:
        notes.append("output truncated")
    if res.timed_out:
        notes.append("killed: wall-clock limit")
    elif res.killed_by == "disk":
        notes.append("killed: disk limit of /testbed exceeded")
    elif res.killed_by:
        notes.append(f"killed by {res.killed_by}")
    head = f"exit code {res.exit_code}" + (f" ({'; '.join(notes)})" if notes else "")
    return f"{head}\n{out}" if out else head


class CodingEnv(Env):
    """One coding episode; see the module docstring for the rules."""

    def __init__(self, task: Task, chat: ChatFormat, max_turns: int = 16, max_no_tool: int = 3,
                 command_timeout: float = 30.0, max_output_chars: int = 4000,
                 grade_on_max_turns: bool = False, limits: SandboxLimits | None = None) -> None:
        if command_timeout <= 0:
            raise ValueError(f"CodingEnv.command_timeout must be > 0, got {command_timeout}")
        if max_output_chars < 64:
            raise ValueError(f"CodingEnv.max_output_chars must be >= 64, got {max_output_chars}")
        for key in ("repo_dir", "tests_dir", "problem_statement", "test_command", "test_files", "FAIL_TO_PASS"):
            if key not in task.data:
                raise ValueError(f"CodingEnv: task {task.prompt_id!r} has no data[{key!r}]")
        ensure_hidden(task.data)
        self.task = task
        self.chat = chat
        self.tracker = TurnTracker(max_turns, max_no_tool)
        self.stop_ids = chat.stop_ids
        self.command_timeout = command_timeout
        self.max_output_chars = max_output_chars
        self.grade_on_max_turns = grade_on_max_turns
        self.limits = limits or SandboxLimits(wall_seconds=command_timeout)
        self.sandbox: Sandbox | None = None
        self.last_grade: GradeResult | None = None

    async def reset(self) -> list[int]:
        await self.close()
        self.tracker = TurnTracker(self.tracker.max_turns, self.tracker.max_no_tool)
        self.sandbox = await Sandbox.create(self.task.data["repo_dir"], self.limits)
        d = self.task.data
        user = f"{d['problem_statement'].strip()}\n\nThe tests run with: {d['test_command']}\n{NUDGE}"
        return self.chat.prompt(user, system=SYSTEM)

    async def _grade(self, close: list[int], status: str, info: dict[str, Any]) -> StepResult:
        assert self.sandbox is not None
        g = await grade_sandbox(self.task.data, self.sandbox)
        self.last_grade = g
        info.update(failed=g.failed[:8], reason=g.reason or info.get("reason", ""), grade_s=round(g.seconds, 3))
        if g.status == "reward_hacked":
            info.update(patch=g.patch, why=g.why)
        return StepResult(close, True, g.reward, status if g.status == "ok" else g.status, info=info)

    async def step(self, generated: list[int], finish_reason: str) -> StepResult:
        # A turn cut at the length limit gets its end-of-turn token from us (loss_mask 0).
        close = [] if generated and generated[-1] in self.stop_ids else [self.chat.end_of_turn_id]
        if self.sandbox is None:
            return StepResult(close, True, None, "infra_failed", info={"error": "step before reset"})
        call = parse_tool_call(self.chat.reply_text(generated))
        try:
            if call is not None and not isinstance(call, Malformed) and call.name == "submit":
                return await self._grade(close, "ok", {"action": "submit"})
            malformed = isinstance(call, Malformed)
            if call is None:
                reply = self.chat.user_turn(NUDGE)
            elif isinstance(call, Malformed):
                reply = self.chat.tool_result(f"error: {call.reason}")
            else:
                res = await self.sandbox.run(call.command, timeout=self.command_timeout)
                if res.killed_by == "disk":
                    return StepResult(close, True, 0.0, "ok", info={"reason": "disk"})
                reply = self.chat.tool_result(format_result(res, self.max_output_chars))
            status = self.tracker.on_reply(call is not None, malformed)
            if status is None:
                return StepResult(close + reply, False, malformed=malformed)
            if status == "max_turns" and self.grade_on_max_turns:
                return await self._grade(close, status, {"action": "max_turns"})
            return StepResult(close, True, 0.0, status, malformed=malformed)
        except SandboxError as e:
            return StepResult(close, True, None, "infra_failed", info={"error": strip_control(f"sandbox: {e}")})

    async def close(self) -> None:
        if self.sandbox is not None:
            sb, self.sandbox = self.sandbox, None
            await sb.close()
