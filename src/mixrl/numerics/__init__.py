"""Number formats: fake quantization of weights, KV cache and activations.

    from mixrl.numerics import quantize_weight, quantize_kv, quantize_activation, FORMATS
    w_q = quantize_weight(w, "nvfp4")          # same dtype and shape as w
    k_q = quantize_kv(k, "fp8_e4m3")           # k: [batch, heads, seq, head_dim]

Formats are listed in ``formats.py``; FP8 layouts are in ``fp8.py``, the
microscaling formats (MXFP8, MXFP4, NVFP4) use torchao's reference
implementations in ``microscaling.py``. To add a format, add its ``FormatSpec``
to ``formats.py`` and its branch to ``quant._apply``.
"""

from mixrl.numerics.formats import FORMATS, ROW_FORMATS, FormatSpec, get_format
from mixrl.numerics.microscaling import e2m1_values
from mixrl.numerics.quant import quantize_activation, quantize_kv, quantize_weight, relative_error

__all__ = [
    "FORMATS",
    "ROW_FORMATS",
    "FormatSpec",
    "e2m1_values",
    "get_format",
    "quantize_activation",
    "quantize_kv",
    "quantize_weight",
    "relative_error",
]
