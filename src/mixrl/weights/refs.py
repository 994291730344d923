"""What the weight store holds for one published version, as each transport makes it.

- ``StateDict``: the trainer's tensors in this process (a detached copy; threads, tests,
  ``mixrl serve``);
- ``SharedVersion``: written once into shared memory, mapped by every worker process
  (``weights.shared``; the embedded backend);
- ``Broadcast``: the version's number only, its tensors sent trainer -> replica over a
  channel (``weights.broadcast``; Ray with ``fleet.broadcast``);
- ``ObjectRef``: a Ray object written once and resolved by each replica's actor (typed by
  its one method here, so this module does not import Ray).

A replica handle's ``load_weights(ref, version)`` takes any of them; a trainer handle's
``weights()`` returns the one its backend makes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeAlias

from mixrl.weights.broadcast import Broadcast
from mixrl.weights.shared import SharedVersion


class ObjectRef(Protocol):
    """A Ray object reference (``ray.ObjectRef``)."""

    def hex(self) -> str: ...


StateDict: TypeAlias = Mapping[str, Any]
WeightsRef: TypeAlias = StateDict | SharedVersion | Broadcast | ObjectRef
