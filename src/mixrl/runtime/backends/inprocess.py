"""The former name of the embedded backend (``runtime.backend = "inprocess"``).

Everything lives in ``mixrl.runtime.backends.embedded``; these names stay
importable so configs and code written against them keep working.
"""

from __future__ import annotations

from mixrl.runtime.backends.embedded import EmbeddedBackend as InProcessBackend
from mixrl.runtime.backends.embedded.threads import EmbeddedTrainer as InProcessTrainer
from mixrl.runtime.backends.embedded.threads import ThreadSampler as InProcessSampler
from mixrl.runtime.backends.embedded.threads import group_profile, replica_seed

__all__ = ["InProcessBackend", "InProcessSampler", "InProcessTrainer", "group_profile", "replica_seed"]
