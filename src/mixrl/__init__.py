"""mixrl: fully asynchronous RL for language models with mixed-precision samplers.

Every sampler group runs its own precision and engine; one trainer keeps its
own precision; off-policy corrections (``mixrl.corrections``) keep the updates
close to on-policy. See docs in the repository for the layers.
"""

__version__ = "0.1.0"

from mixrl.runtime.quiet import install_filters as _quiet  # noqa: E402 - torchao's missing-CUDA-kernel warnings

_quiet()
