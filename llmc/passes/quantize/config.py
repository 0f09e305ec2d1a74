"""`QuantConfig`: what `llmc compile --quant ...` and `llmc.compile(..., quant=...)` ask for.

Methods, each ending in a `qlinear` format (llmc/ir/quant.py):

- ``rtn``: round to nearest, int4 (default group 128) or int8 (default per channel);
- ``gptq``: the same formats, Hessian-based error feedback on calibration data (gptq.py);
- ``awq``: the same formats, activation-aware per-channel scales folded into the previous op (awq.py);
- ``smoothquant``: int8 weights and per-token int8 activations, activation outliers migrated into the
  weights with strength ``alpha`` (smoothquant.py);
- ``fp8``: e4m3 weights (per channel) and per-token e4m3 activations;
- ``mixed``: per linear, int4 g128 (GPTQ), int8 (GPTQ) or kept in the model dtype, chosen from each
  linear's measured sensitivity to minimise the estimated error under ``bits_budget`` (mixed.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from llmc.errors import CompileError
from llmc.ir.quant import MIN_GROUP, QuantFormat

METHODS = ("rtn", "gptq", "awq", "smoothquant", "fp8", "mixed")
CALIBRATED = ("gptq", "awq", "smoothquant", "mixed")


@dataclass(frozen=True)
class QuantConfig:
    """Weight quantization options.

    Args:
        method: one of rtn, gptq, awq, smoothquant, fp8, mixed.
        wbits: 4 or 8 (rtn, gptq, awq; smoothquant and fp8 are 8-bit).
        group_size: input columns per scale; None: 128 for 4 bits, per channel for 8; 0: per channel.
        zeros: asymmetric int weights with zero points.
        calib: calibration text: a .txt file, or builtin:heldout (the second half of the shipped
            held-out text; `llmc eval` reads its beginning).
        calib_samples: calibration windows.
        calib_len: tokens per window.
        bits_budget: mixed: the average bits per weight of the quantized linears, scales included.
        act_order: gptq: quantize columns in order of decreasing activation energy.
        damp: gptq: Hessian damping, relative to its mean diagonal. 0.1 rather than the paper's 0.01:
            on tiny-py with 32k calibration tokens, 0.01 fits the calibration text and loses on other text.
        scale_search: gptq, mixed: shrink factors of each group's range tried (0: min-max scales).
        alpha: smoothquant: migration strength.
        skip: linears kept in the model dtype, by name suffix (the LM head by default; `--quant-lm-head`
            empties it).
        embeddings: "int8": the input embedding table as int8 rows with a scale each (embedding.py);
            None: kept in the model dtype.
    """

    method: str = "rtn"
    wbits: int = 4
    group_size: int | None = None
    zeros: bool = False
    calib: str = "builtin:heldout"
    calib_samples: int = 128
    calib_len: int = 256
    bits_budget: float = 4.5
    act_order: bool = False
    damp: float = 0.1
    scale_search: int = 20
    alpha: float = 0.5
    skip: tuple[str, ...] = ("lm_head",)
    embeddings: str | None = None

    def __post_init__(self):
        self._check_types()
        if self.embeddings not in (None, "int8"):
            raise CompileError(f"--quant-embeddings takes int8, not {self.embeddings!r}")
        if self.method not in METHODS:
            raise CompileError(f"--quant must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.wbits not in (4, 8):
            raise CompileError(f"--wbits must be 4 or 8, not {self.wbits}")
        if self.group_size is not None and (self.group_size < 0 or self.group_size % MIN_GROUP):
            raise CompileError(f"--group-size must be 0 (per channel) or a positive multiple of {MIN_GROUP} (the "
                               f"fewest input columns the quantized kernels take per scale), not {self.group_size}")
        if self.calib_samples < 1 or self.calib_len < 2:
            raise CompileError("--calib-samples must be >= 1 and the calibration length >= 2")
        if not 4 <= self.bits_budget <= 16:
            raise CompileError(f"--bits-budget must lie between 4 and 16 bits per weight, not {self.bits_budget}")
        if not 0 <= self.alpha <= 1 or self.damp <= 0:
            raise CompileError("alpha must lie in [0, 1] and damp be > 0")
        if self.needs_calibration and not self.calib.startswith("builtin:") and not Path(self.calib).is_file():
            raise CompileError(f"--calib {self.calib}: no such file; give a text file or builtin:heldout")
        if self.calib.startswith("builtin:") and self.calib != "builtin:heldout":
            raise CompileError(f"--calib {self.calib}: the built-in calibration text is builtin:heldout")

    def _check_types(self) -> None:
        """A TypeError naming an option given a value of the wrong type (a dict of options from Python); `skip`
        given as one string is one module name (it was read letter by letter), any other iterable a tuple."""
        from llmc.passes.manager import fits_kind
        if not isinstance(self.skip, tuple):
            object.__setattr__(self, "skip", (self.skip,) if isinstance(self.skip, str) else tuple(self.skip))
        kinds = {"int": (int, "an int"), "float": (float, "a number"), "bool": (bool, "a bool"), "str": (str, "a string")}
        for f in dataclasses.fields(self):
            value, annotation = getattr(self, f.name), str(f.type).split(" | ")[0]
            if value is None or annotation not in kinds:
                continue
            kind, text = kinds[annotation]
            if not fits_kind(value, kind):
                raise TypeError(f"quantization option {f.name} takes {text}, not {type(value).__name__} {value!r}")
        if not all(isinstance(x, str) for x in self.skip):
            raise TypeError(f"quantization option skip takes module names (strings), not {self.skip!r}")

    @classmethod
    def coerce(cls, value) -> "QuantConfig | None":
        """A QuantConfig from itself, a method name, a dict of options, or None."""
        if value is None or isinstance(value, QuantConfig):
            return value
        if isinstance(value, str):
            return cls(method=value)
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise CompileError(f"unknown quantization options {sorted(unknown)}")
            return cls(**value)  # skip: a name or names, made a tuple by __post_init__
        raise CompileError(f"quant= takes a QuantConfig, a method name or a dict, not {type(value).__name__}")

    @property
    def needs_calibration(self) -> bool:
        return self.method in CALIBRATED

    def format(self) -> QuantFormat:
        """The format every planned linear gets (mixed chooses per linear; see mixed.py)."""
        if self.method == "smoothquant":
            return QuantFormat("w8a8", 8)
        if self.method == "fp8":
            return QuantFormat("fp8", 8)
        g = self.group_size if self.group_size is not None else (128 if self.wbits == 4 else 0)
        return QuantFormat("int", self.wbits, g, self.zeros)

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
