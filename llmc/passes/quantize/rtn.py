"""Round-to-nearest: each weight to its nearest code on a min-max grid, per group or per channel.

No calibration; the baseline every other method is measured against (llmc/ir/quant.py holds the
rounding itself, shared with GPTQ and AWQ).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmc.ir.quant import quantize_rtn
from llmc.passes.manager import register_pass
from llmc.passes.quantize.materialize import QuantizePass, entry_format, scale_dtype


@register_pass
@dataclass
class RTNQuantize(QuantizePass):
    name: ClassVar[str] = "quantize_rtn"
    method: ClassVar[str] = "rtn"

    def quantize_group(self, g, ctx, x, items, s):
        return [(n, quantize_rtn(self.weight(g, n), entry_format(e), scale_dtype(g, n))) for n, e in items]
