"""Keep third-party noise out of a run's output.

Silenced (they do not concern a CPU run or the user): torchao's warnings
about CUDA extensions it cannot load (``Failed to load ..._C_mxfp8...so``),
torch's ``_pytree`` deprecation notes, transformers' per-load "Loading
weights" bars and info logs, and the progress bars and info lines of
``datasets`` and ``huggingface_hub``. Environment variables carry the
settings to worker processes; logger filters cover this process. Errors
still get through: only warnings and below are dropped, and only from these
libraries.
"""

from __future__ import annotations

import logging
import os
import warnings

_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_SILENT": "true",
    "TORCH_LOGS": "-torch",  # torch's own loggers at ERROR in worker processes too (the _pytree notes)
}
class _NoMissingKernels(logging.Filter):
    """Drop torchao's "Failed to load <extension>.so" warnings (CUDA-only kernels)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("Failed to load") and ".so" in msg)


def install_filters() -> None:
    """Cheap and import-free: run by every entry point (the CLI, ``train``, worker processes) and
    before torchao is imported (``mixrl.numerics.torchao_ref``); idempotent."""
    lg = logging.getLogger("torchao")
    if not any(isinstance(f, _NoMissingKernels) for f in lg.filters):
        lg.addFilter(_NoMissingKernels())
    os.environ.setdefault("TORCH_LOGS", "-torch")  # read when torch is imported: the _pytree notes


_LOGGERS = ("torchao", "torch.utils._pytree", "transformers", "datasets", "huggingface_hub", "accelerate", "peft")
_done = False


def silence_libraries() -> None:
    """Idempotent; call before the libraries are imported where possible."""
    global _done
    if _done:
        return
    _done = True
    install_filters()
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"torch\.utils\._pytree")
    warnings.filterwarnings("ignore", message=r".*is an Enum subclass.*")
    warnings.filterwarnings("ignore", module=r"torchao(\..*)?")


def quiet_loaded() -> None:
    """Settings that need the library imported (call after importing transformers)."""
    import sys

    if "transformers" in sys.modules:
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
