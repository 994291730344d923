"""Modelled sampling cost per sampler group.

Nothing here is measured on a GPU: the cost of a group's tokens is *modelled*
as the GPU-seconds its profile would need at the profile's stated throughput,
times the profile's price:

    gpu_seconds_g = tokens_generated_g / tokens_per_second_g
    cost_g        = gpu_seconds_g * price_per_hour_g / 3600

Prices and throughputs are data in the profile catalogue (public list prices by
default, meant to be edited). Metric names carry ``cost/`` and the total is the
exact sum of the per-group figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GroupPrice:
    price_per_hour: float  # USD per GPU-hour (modelled)
    tokens_per_second: float  # modelled GPU throughput of the profile

    def __post_init__(self) -> None:
        if self.price_per_hour < 0:
            raise ValueError(f"price_per_hour must be >= 0, got {self.price_per_hour}")
        if not self.tokens_per_second > 0:
            raise ValueError(f"tokens_per_second must be > 0, got {self.tokens_per_second}")


@dataclass
class CostModel:
    """Cumulative modelled cost per group; ``update`` is called once per trainer step."""

    prices: dict[str, GroupPrice]
    cumulative: dict[str, float] = field(default_factory=dict)
    cumulative_gpu_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_profiles(cls, group_profiles: Mapping[str, object]) -> CostModel:
        """``group_profiles``: group name -> Profile (anything with the two price fields)."""
        prices = {
            g: GroupPrice(float(p.price_per_hour), float(p.tokens_per_second))  # type: ignore[attr-defined]
            for g, p in group_profiles.items()
        }
        return cls(prices)

    def update(self, tokens_by_group: Mapping[str, int]) -> dict[str, float]:
        """Account the tokens generated since the last update; return ``cost/*`` metrics."""
        out: dict[str, float] = {}
        total = 0.0
        for g, n in tokens_by_group.items():
            if g not in self.prices:
                raise ValueError(f"unknown sampler group {g!r}; known: {sorted(self.prices)}")
            if n < 0:
                raise ValueError(f"tokens for group {g!r} must be >= 0, got {n}")
            price = self.prices[g]
            gpu_s = n / price.tokens_per_second
            cost = gpu_s * price.price_per_hour / 3600.0
            self.cumulative[g] = self.cumulative.get(g, 0.0) + cost
            self.cumulative_gpu_s[g] = self.cumulative_gpu_s.get(g, 0.0) + gpu_s
            out[f"cost/update/{g}"] = cost
            total += cost
        for g in self.prices:
            out[f"cost/cumulative/{g}"] = self.cumulative.get(g, 0.0)
            out[f"cost/gpu_seconds/{g}"] = self.cumulative_gpu_s.get(g, 0.0)
        out["cost/update"] = total
        out["cost/cumulative"] = sum(self.cumulative.values())
        return out

    def state_dict(self) -> dict[str, dict[str, float]]:
        return {"cumulative": dict(self.cumulative), "gpu_s": dict(self.cumulative_gpu_s)}

    def load_state_dict(self, state: Mapping[str, Mapping[str, float]]) -> None:
        self.cumulative = dict(state["cumulative"])
        self.cumulative_gpu_s = dict(state["gpu_s"])
