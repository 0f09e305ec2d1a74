"""onnxruntime as the oracle of the ONNX frontend: the same token ids through onnxruntime and through
llmc's reference interpreter, and the largest logit difference.

The llmc side runs the graph it is given: the captured `[B, S]` graph, or a compiled paged graph (one
prefill step over all the sequences, logits at every position), so the check covers the passes too.
onnxruntime is fed what llmc's contract says (positions 0..S-1, an all-ones attention mask, empty past
caches). `onnxruntime` (CPU) is enough; `onnxruntime-gpu` is the package for GPU machines.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.errors import CompileError
from llmc.ir.graph import Graph
from llmc.ir.types import dim_eval, torch_dtype

BLOCK = 16


@dataclass
class OrtCheck:
    """The largest |llmc - onnxruntime| logit difference over `tokens` positions of `lengths` sequences."""

    max_abs_diff: float
    max_rel_diff: float  # over the largest |logit| onnxruntime gave
    lengths: list[int]
    provider: str

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def __str__(self) -> str:
        return (f"onnxruntime check: largest |logit difference| {self.max_abs_diff:.3g} ({self.max_rel_diff:.3g} "
                f"relative) over {self.tokens} positions of {len(self.lengths)} sequences "
                f"({self.provider})")


# the largest difference from onnxruntime, relative to the logits' scale, that the compute dtype's rounding
# explains, by the IR's dtype name (fp32 runs give ~1e-6, bf16 exports ~1e-2: tests/frontend/test_onnx.py);
# above it the artifact computes something else
TOLERANCE = {"f32": 1e-3, "f16": 5e-2, "bf16": 5e-2}


def require_onnxruntime():
    """onnxruntime, or a CompileError saying how to install it."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise CompileError("the onnxruntime check needs onnxruntime: pip install onnxruntime (onnxruntime-gpu on "
                           "GPU machines)") from None
    return ort


def _session(path: Path):
    ort = require_onnxruntime()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
    try:
        return ort.InferenceSession(str(path), opts, providers=providers)
    except Exception as e:
        raise CompileError(f"onnxruntime cannot load {path}: {str(e).splitlines()[0][:300]}") from None


def ort_logits(sess, ids: torch.Tensor) -> torch.Tensor:
    """onnxruntime's logits [S, V] for one sequence of token ids [S], fed by llmc's contract."""
    import numpy as np
    s = int(ids.shape[0])
    np_types = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
                "tensor(float16)": np.float16, "tensor(double)": np.float64}
    feeds = {}
    for i in sess.get_inputs():
        t = np_types.get(i.type)
        if i.name == "input_ids":
            feeds[i.name] = ids.numpy()[None].astype(t)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(s, dtype=t)[None]
        elif i.name == "cache_position":
            feeds[i.name] = np.arange(s, dtype=t)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, s), dtype=t)
        elif len(i.shape) == 4 and t is not None:  # a past cache: batch 1, past length 0
            dims = [1 if k == 0 else d if isinstance(d, int) else 0 for k, d in enumerate(i.shape)]
            feeds[i.name] = np.zeros(dims, dtype=t)
        else:
            raise CompileError(f"the onnxruntime check does not know how to feed the input {i.name} {i.shape}")
    out = sess.run(None, feeds)[0]
    return torch.from_numpy(np.asarray(out, dtype=np.float32))[0]


def llmc_logits(g: Graph, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """llmc's logits [S, V] per sequence: a paged graph runs one prefill of all of them, a captured
    graph one call per sequence."""
    from llmc.ir.interpreter import Interpreter
    it = Interpreter(g)
    if not g.meta.get("paged"):
        return [it.run(input_ids=s[None], position_ids=torch.arange(len(s))[None])[0][0].float() for s in seqs]
    blocks = [-(-len(s) // BLOCK) for s in seqs]
    first = [sum(blocks[:i]) for i in range(len(seqs))]
    env = {"NB": sum(blocks), "BS": BLOCK}
    feeds = {
        "input_ids": torch.cat(seqs), "positions": torch.cat([torch.arange(len(s)) for s in seqs]),
        "query_start_loc": torch.tensor([0] + [sum(map(len, seqs[:i + 1])) for i in range(len(seqs))],
                                        dtype=torch.int32),
        "seq_lens": torch.tensor([len(s) for s in seqs], dtype=torch.int32),
        "block_tables": torch.tensor([[f + j if j < n else 0 for j in range(max(blocks))]
                                      for f, n in zip(first, blocks)], dtype=torch.int32),
        "slot_mapping": torch.cat([f * BLOCK + torch.arange(len(s)) for f, s in zip(first, seqs)]),
        "logits_indices": torch.arange(sum(map(len, seqs))),
    }
    for v in g.inputs:
        if v.name not in feeds:  # the KV caches (and their scales)
            feeds[v.name] = torch.zeros([dim_eval(d, env) for d in v.type.shape], dtype=torch_dtype(v.type.dtype))
    (out,) = it.run(feeds)
    return list(torch.split(out.float(), [len(s) for s in seqs]))


def check_onnxruntime(onnx_path: str | Path, graph: Graph, lengths: tuple[int, ...] = (7, 19),
                      seed: int = 0) -> OrtCheck:
    """Run random token ids through onnxruntime and llmc's interpreter and compare the logits.

    Args:
        onnx_path: the .onnx file the graph was compiled from.
        graph: llmc's graph of it: `capture_onnx`'s, or a compiled artifact's (`art.graph`).
        lengths: the sequence lengths to try.
    Returns:
        The largest differences (an OrtCheck; str() gives a one-line report).

    Example:
        >>> art = llmc.compile("model.onnx", "model.llmc")          # doctest: +SKIP
        >>> print(check_onnxruntime("model.onnx", art.graph))       # doctest: +SKIP
        onnxruntime check: largest |logit difference| 2.1e-06 ...
    """
    sess = _session(Path(onnx_path))
    vocab = int(graph.outputs[0].type.shape[-1])
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    ours = llmc_logits(graph, seqs)
    theirs = [ort_logits(sess, s) for s in seqs]
    diff = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    scale = max(float(b.abs().max()) for b in theirs) or 1.0
    return OrtCheck(diff, diff / scale, list(lengths), sess.get_providers()[0])
