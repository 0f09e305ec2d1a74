"""FP8 W8A8: e4m3 weights with one fp32 scale per output channel (amax / 448); the activations are
quantized per token at run time (the qlinear kernel does it). No calibration: e4m3's exponent
covers the activations' range where int8 would need SmoothQuant's migration. Native on Hopper."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.ir.quant import quantize_rtn
from llmc.passes.manager import register_pass
from llmc.passes.quantize.materialize import QuantizePass, entry_format


@register_pass
@dataclass
class FP8Quantize(QuantizePass):
    name: ClassVar[str] = "quantize_fp8"
    method: ClassVar[str] = "fp8"

    def quantize_group(self, g, ctx, x, items, s):
        return [(n, quantize_rtn(self.weight(g, n), entry_format(e))) for n, e in items]
