"""Shared settings of the correction tests: one thread (the CI machine is shared)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
