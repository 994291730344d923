"""The built-in engine on another device than the CPU (``BuiltinEngine(device=...)``).

A CPU machine has no GPU, so the engine runs on ``fakegpu`` (tests/fake_device.py: torch's
PrivateUse1 slot, CPU memory inside) under ``strict()``, where an op that mixes device and
CPU tensors fails as it does on CUDA. The reference is the same engine on the CPU: FP32
differs only by the GEMM kernel (MKL on the CPU, the plain GEMM on a device), real FP8
(``torch._scaled_mm`` on both) not at all.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mixrl.models.policy import resolve
from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.sampling.builtin.engine import BuiltinEngine
from mixrl.sampling.profiles import get_profile
from tests import fake_device

pytestmark = pytest.mark.fakegpu  # installs the device in this process: runs last (tests/conftest.py)


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return fake_device.install()


@pytest.fixture
def strict(dev: torch.device) -> Iterator[torch.device]:
    with fake_device.strict():
        yield dev


def _requests(session: str | None = None) -> list[GenerationRequest]:
    return [GenerationRequest(request_id=f"r{i}", prompt_ids=list(range(5, 8 + i % 4)), session=f"{session}{i}" if session else "",
                              params=SamplingParams(max_new_tokens=10 + 2 * i, seed=i, top_p=0.9 if i % 2 else 1.0))
            for i in range(6)]


def test_strict_mode_fails_on_mixed_devices(strict: torch.device) -> None:
    x = torch.ones(3, 2).to(strict)
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(3, 2)
    assert (x * torch.tensor(2.0)).device == strict  # a CPU scalar is fine, as on CUDA
    assert type((x * 2).cpu()) is torch.Tensor


@pytest.mark.parametrize("profile,tol", [("fp32", 1e-4), ("h100-fp8-scaled", 0.0)])
def test_the_engine_on_a_device_samples_what_it_samples_on_the_cpu(strict: torch.device, profile: str,
                                                                   tol: float) -> None:
    model = str(resolve("bundled"))
    ref = BuiltinEngine(model, get_profile(profile), "cpu").generate_batch(_requests())  # CPU tensors only
    e = BuiltinEngine(model, get_profile(profile), "dev", device=str(strict))
    layer = e.weights.layers[0]
    assert {e.weights.embed.device, e.weights.cos.device, layer.ln1.device} == {strict}
    got = e.generate_batch(_requests())
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    diff = max(abs(a - b) for x, y in zip(got, ref, strict=True) for a, b in zip(x.logprobs, y.logprobs, strict=False))
    assert diff <= tol, diff
    assert all(r.finish_reason in ("stop", "length") for r in got)


def test_sessions_weights_and_streams_on_a_device(strict: torch.device) -> None:
    """A session's KV kept on the device and reused by its next turn, new weights loaded
    there, requests joining a running batch."""
    from transformers import AutoModelForCausalLM

    model = str(resolve("bundled"))
    e = BuiltinEngine(model, get_profile("fp32"), "dev", device=str(strict))
    first = e.generate_batch(_requests("s"))
    nxt = [GenerationRequest(request_id=f"n{i}", session=f"s{i}", prompt_ids=r.prompt_ids + f.token_ids + [9],
                             params=SamplingParams(max_new_tokens=6, seed=7))
           for i, (r, f) in enumerate(zip(_requests("s"), first, strict=True))]
    again = e.generate_batch(nxt)
    assert sum(r.timings["reused_tokens"] for r in again) > 0 and all(r.token_ids for r in again)
    sd = AutoModelForCausalLM.from_pretrained(model).state_dict()
    e.load_weights({k: v * 0.9 if v.dim() == 2 else v for k, v in sd.items()}, version=3)
    assert e.weights.layers[1].ln2.device == strict
    run = e.stream()
    run._admit([(0, _requests()[0], 1)])
    run.step()
    run._admit([(1, _requests()[3], 2)])  # joins the running batch (absorbed into its KV cache)
    out = []
    while run.rows:
        out += run.step()
    assert sorted(k for k, _ in out) == [0, 1] and all(r.version == 3 for _, r in out)


def test_a_device_this_process_lacks_is_one_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ValueError, match="device='cuda': this process sees no CUDA device"):
        BuiltinEngine(str(resolve("bundled")), get_profile("fp32"), "g", device="cuda")


def test_the_generic_path_stays_on_the_cpu(dev: torch.device) -> None:
    with pytest.raises(ValueError, match="fast path only"):
        BuiltinEngine(str(resolve("bundled")), get_profile("fp32"), "g", device=str(dev), forward="generic")

