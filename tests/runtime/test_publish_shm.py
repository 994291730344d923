"""One version in shared memory: written once, mapped back bit-exact, freed when retired."""

from __future__ import annotations

import torch

from mixrl.fleet.shared_weights import ALIGN, SharedVersion, map_manifest


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
