"""Shared by the sandbox test files: the attack and reward-hack tables printed in pytest's
terminal summary, and the private root every sandbox test runs under.

Each attack records a row (attack, mechanism, contained, detail); each reward hack a row
(hack, grading form, reward, status, reason, control); the tables are printed once, also
without ``-s``. ``private_root`` gives each test its own episode root and checks,
afterwards, that every episode was removed, that no cleanup failed, and that neither the
root's parent nor the system temp dir changed mode: a failing test can never damage the
host's shared temporary directory.

(PYTEST_DONT_REWRITE: the test modules import this before pytest loads it as a plugin; its
assertions carry their own messages.)
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator

import pytest

from mixrl.envs import sandbox as sbmod

ATTACKS: list[tuple[str, str, bool, str]] = []  # (attack, mechanism, contained, detail)
HACKS: list[tuple[str, str, float, str, str, str]] = []  # (hack, form, reward, status, reason, control)
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


class AttackTable:
    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        if not ATTACKS:
            return
        tr = terminalreporter
        tr.section("sandbox attacks")
        w = max(len(a) for a, *_ in ATTACKS)
        m = max(len(b) for _, b, *_ in ATTACKS)
        for attack, mech, ok, detail in ATTACKS:
            tr.write_line(f"{attack:<{w}}  {mech:<{m}}  {'contained' if ok else 'NOT CONTAINED'}  {detail}")
        n_ok = sum(1 for *_, ok, _ in ATTACKS if ok)
        tr.write_line(f"{n_ok}/{len(ATTACKS)} attacks contained")


class HackTable:
    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        if not HACKS:
            return
        tr = terminalreporter
        tr.section("reward hacks")
        w = max(len(h) for h, *_ in HACKS)
        for hack, form, reward, status, why, control in HACKS:
            tr.write_line(f"{hack:<{w}}  {form:<6}  reward={reward:.0f}  {status:<13}  {why:<26}  {control}")
        hacks = [(r, s) for h, _, r, s, *_ in HACKS if "(control)" not in h]
        tr.write_line(f"{sum(1 for r, _ in hacks if r == 0)}/{len(hacks)} hacks earned 0, "
                      f"{sum(1 for _, s in hacks if s == 'infra_failed')} infra_failed")


def register(request: pytest.FixtureRequest) -> None:
    pm = request.config.pluginmanager
    if not pm.has_plugin("mixrl-sandbox-attacks"):
        pm.register(AttackTable(), "mixrl-sandbox-attacks")
    if not pm.has_plugin("mixrl-reward-hacks"):
        pm.register(HackTable(), "mixrl-reward-hacks")


def record_hack(hack: str, form: str, reward: float, status: str, reason: str, control: str = "") -> None:
    HACKS.append((hack, form, reward, status, reason[:26], control[:90].replace("\n", " ")))


def record(attack: str, mechanism: str, contained: bool, detail: str = "") -> None:
    ATTACKS.append((attack, mechanism, contained, detail[:100].replace("\n", " ")))
    assert contained, f"{attack}: {detail}"


def _mode(p: str) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture
def private_root() -> Iterator[str]:
    """A fresh episode root for one test (the sandbox uid must traverse it, so it is made
    in the system temp dir, not under pytest's 0700 ``tmp_path``; only it is ever changed)."""
    tmp = tempfile.gettempdir()
    before = _mode(tmp)
    fails = dict(+sbmod.FAILURES)
    root = tempfile.mkdtemp(prefix="mixrl-test-root-", dir=tmp)
    os.chmod(root, 0o711)  # our own new directory: the sandbox uid may traverse it
    old = (sbmod.HOST.root, sbmod.HOST.total_memory_bytes)
    sbmod.configure(root=root, total_memory_bytes=old[1])
    try:
        yield root
    finally:
        sbmod.configure(root=old[0], total_memory_bytes=old[1])
        left = os.listdir(root)
        if not left:
            os.rmdir(root)
        assert _mode(tmp) == before, f"the mode of {tmp} changed: {oct(before)} -> {oct(_mode(tmp))}"
        assert not left, f"episodes left behind in {root}: {left[:5]}"
        assert dict(+sbmod.FAILURES) == fails, f"cleanup failures: {dict(sbmod.FAILURES)}"
