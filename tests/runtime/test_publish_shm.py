"""One version in shared memory: written once, mapped back bit-exact, freed when retired."""

from __future__ import annotations

import torch

from mixrl.weights.shared import ALIGN, SharedVersion, map_manifest


def test_every_dtype_and_layout_maps_back_bit_exact() -> None:
    g = torch.Generator().manual_seed(0)
    sd = {
        "w": torch.randn(5, 7, generator=g),
        "t": torch.randn(7, 5, generator=g).t(),  # not contiguous
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "h": torch.randn(3, generator=g).to(torch.float16),
        "mask": torch.tensor([True, False, True]),
        "step": torch.tensor(3, dtype=torch.int64),  # 0-dim
        "empty": torch.zeros(0, 4),
        "grad": torch.randn(2, 2, generator=g, requires_grad=True),
    }
    sv = SharedVersion.from_state_dict(sd)
    man = sv.manifest()
    assert all(off % ALIGN == 0 for _, _, _, off in man.values())
    got = map_manifest(man)
    assert set(got) == set(sd)
    for k, want in sd.items():
        assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
        assert torch.equal(got[k], want.detach()), k
    sv.acquire()
    sv.retire()
    assert sv._files[0].exists()  # a load holds it
    sv.release()
    assert not any(p.exists() for p in sv._files)


def test_a_freed_version_is_renamed_at_once_and_unlinked_off_the_caller_thread(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading
    import time
    from pathlib import Path

    unlinked: list[tuple[str, str]] = []
    real = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        unlinked.append((self.name, threading.current_thread().name))
        real(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    sv = SharedVersion.from_state_dict({"w": torch.randn(64, 64)})
    path = sv._files[0]
    sv.retire()
    assert not path.exists()  # gone from its name at once: no new load can start from it
    gone = path.name + ".gone"
    deadline = time.monotonic() + 10
    while gone not in [name for name, _ in unlinked] and time.monotonic() < deadline:
        time.sleep(0.01)
    # freed by the background thread (which may also free versions earlier tests retired)
    assert [thread for name, thread in unlinked if name == gone] == ["mixrl-shm-janitor"]
    assert all(thread == "mixrl-shm-janitor" and name.endswith(".gone") for name, thread in unlinked)
    assert not path.with_name(path.name + ".gone").exists()


def test_map_manifest_views_are_contiguous_at_their_offsets() -> None:
    sd = {"a": torch.arange(6, dtype=torch.int16).view(2, 3), "b": torch.randn(3, 1, 2), "c": torch.tensor(True)}
    got = map_manifest(SharedVersion.from_state_dict(sd).manifest())
    for k, want in sd.items():
        assert got[k].is_contiguous() and got[k].stride() == want.stride() and torch.equal(got[k], want), k


def test_a_process_that_exits_without_cleanup_leaves_no_directory() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = ("import torch\nfrom mixrl.weights.shared import SharedVersion\n"
            "sv = SharedVersion.from_state_dict({'w': torch.ones(4)})\nprint(sv._files[0].parent)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    folder = Path(out.stdout.strip().splitlines()[-1])
    assert folder.name.startswith("mixrl-w-") and not folder.exists()
