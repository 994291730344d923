"""mixrl.corrections: pure tensor math of the off-policy corrections (CORRECTIONS.md)."""

from mixrl.corrections.types import LossInputs

__all__ = ["LossInputs"]
