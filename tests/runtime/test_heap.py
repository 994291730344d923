"""settle_heap / settled_heap: the start-up heap leaves the collector's generations, and comes back."""

from __future__ import annotations

import gc

from mixrl.system.heap import settled_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector can free it


def tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_a_settled_scope_freezes_what_lives_at_its_start_and_returns_it_at_its_end() -> None:
    before = Node()
    assert tracked(before)
    with settled_heap():
        assert gc.get_freeze_count() > 0
        assert not tracked(before)  # frozen: no generation holds it, full collections skip it
        during = Node()
        assert tracked(during)  # what the scope allocates is collected as usual
    assert gc.get_freeze_count() == 0 and tracked(before)
    ref = id(before)
    del before
    gc.collect()
    assert not any(id(o) == ref and isinstance(o, Node) for o in gc.get_objects())  # its cycle is freed again
