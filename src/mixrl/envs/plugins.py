"""User code named in a config: ``path/to/file.py`` or ``package.module``, and ``...:name`` in it.

    module = load_module("examples/agent.py", what="env.name 'openai_agent:...'")
    fn = load_attr("reward.py:exact_match", what="reward function 'reward.py:exact_match'")

A file is imported once per resolved path (under a private module name, so two
files with the same stem do not collide). Every failure is a ``ValueError``
(or the ``error`` class given) whose one line starts with ``what``: what the
user wrote, and what is wrong with it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_module(target: str, *, what: str, error: type[Exception] = ValueError) -> Any:
    """Import ``target``: a ``.py`` file (relative to the working directory) or a module name."""
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise error(f"{what}: file {target} not found")
        name = "mixrl_user_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        if name in sys.modules:
            return sys.modules[name]
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise error(f"{what}: importing {target} failed: {type(e).__name__}: {e}") from None
        return module
    try:
        return importlib.import_module(target)
    except Exception as e:
        raise error(f"{what}: cannot import {target} ({type(e).__name__}: {e})") from None


def load_attr(spec: str, *, what: str, error: type[Exception] = ValueError) -> Any:
    """``"file.py:name"`` or ``"package.module:name"`` -> the callable ``name`` in it."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise error(f"{what}: expected 'file.py:function' or 'package.module:function'")
    module = load_module(target, what=what, error=error)
    obj = getattr(module, name, None)
    if not callable(obj):
        avail = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise error(f"{what}: {target} has no function {name!r}; it has {avail}")
    return obj
