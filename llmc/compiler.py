"""`llmc.compile`: frontend ▸ pass pipeline ▸ artifact."""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from llmc.codegen import triton_setup
from llmc.codegen.precompile import CompilePool, tune_processes
from llmc.errors import CompileError
from llmc.ir.graph import Graph
from llmc.ir.ops import FLOAT_LINEARS, linear_weight_inputs
from llmc.ir.types import torch_dtype
from llmc.passes.manager import Pass, PassContext, PassManager
from llmc.artifact import MANIFEST, Artifact, ArtifactWriter, has_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_model(model: str | Path) -> tuple[Path, str]:
    """A model argument as a local directory: `builtin:NAME` or a path. Returns (dir, source label)."""
    s = str(model)
    if s.startswith("builtin:"):
        from llmc.models import builtin_dir
        try:
            return Path(builtin_dir(s.split(":", 1)[1])), s
        except (ValueError, FileNotFoundError) as e:
            raise CompileError(str(e)) from None
    p = Path(s).expanduser()
    if is_onnx(p):
        raise CompileError(f"{p}: an ONNX model cannot be used here; give a Hugging Face directory or builtin:NAME")
    return p, str(p.resolve())


def is_onnx(model: Any) -> bool:
    """Whether a model argument names an ONNX file (compiled by llmc/frontend/onnx.py)."""
    return isinstance(model, (str, Path)) and Path(str(model)).suffix.lower() == ".onnx"


def _check_tokenizer_fits(directory: Path, vocab: int) -> None:
    """A tokenizer given for a model (--tokenizer) must not make ids past the model's vocabulary (the
    embedding table would be indexed past its end at run time)."""
    from llmc.tokenizer import load_tokenizer
    try:
        n = len(load_tokenizer(directory))
    except Exception as e:  # a tokenizer that cannot load is the run's error to give, with its own message
        log.debug("tokenizer %s not checked: %s", directory, e)
        return
    if n > vocab:
        raise CompileError(f"the tokenizer in {directory} has {n} tokens and the model's vocabulary {vocab}: its "
                           f"ids {vocab} to {n - 1} would index past the model's embedding table. Give the tokenizer "
                           "the model was trained with (--tokenizer DIR)")


def capture(model: Any, example_inputs: Sequence[torch.Tensor] | None = None, dtype: str | None = None,
            dynamic: dict | None = None, tokenizer: str | Path | None = None,
            status=None) -> tuple[Graph, str, list[Path]]:
    """Run the right frontend. Returns the graph, a source label and the tokenizer files to ship. `status`:
    called with a line as each part of a Hugging Face capture starts. `dtype` None: an ONNX file's own
    precision, float32 for the rest."""
    if dtype is not None and dtype not in DTYPES:
        raise CompileError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if is_onnx(model):
        from llmc.frontend.onnx import capture_onnx
        path = Path(str(model)).expanduser()
        g, tok_files = capture_onnx(path, DTYPES[dtype] if dtype else None, tokenizer)
        if tokenizer is not None and has_tokenizer(tok_files):
            _check_tokenizer_fits(tok_files[0].parent, int(g.outputs[0].type.shape[-1]))
        return g, str(path.resolve()), tok_files
    if tokenizer is not None:
        raise CompileError("--tokenizer is for ONNX models; a Hugging Face directory ships its own tokenizer files")
    dtype = dtype or "float32"
    if isinstance(model, torch.nn.Module):
        if example_inputs is None:
            raise CompileError("compiling an nn.Module needs example_inputs (a tuple of tensors)")
        from llmc.frontend.torch_export import capture as capture_module
        names = [p for p in inspect.signature(model.forward).parameters][:len(example_inputs)]
        model = model.to(DTYPES[dtype]).eval() if dtype != "float32" else model.eval()
        g = capture_module(model, example_inputs, names, dynamic, name=type(model).__name__.lower())
        return g, f"module:{type(model).__qualname__}", []
    from llmc.frontend.hf import TOKENIZER_FILES, capture_hf
    path, source = resolve_model(model)
    g = capture_hf(path, DTYPES[dtype], status=status)
    return g, source, [path / f for f in TOKENIZER_FILES if (path / f).is_file()]


def compile(model: Any, output: str | Path | None = None, *, example_inputs=None, dtype: str | None = None,
            passes: Sequence[Pass] | None = None, before: str | None = None, after: str | None = None,
            dynamic: dict | None = None, verify: bool = False, dump_ir: str | Path | None = None,
            progress: bool = False, tune: bool = True, batch_invariant: bool = True, tuning_cache: bool = True,
            quant=None, draft: str | Path | None = None, tokenizer: str | Path | None = None, **options) -> Artifact:
    """Compile a model into an artifact.

    Args:
        model: a local Hugging Face directory, `builtin:NAME`, an ONNX file (`model.onnx`), or an
            `nn.Module` (with `example_inputs`).
        output: the artifact directory to write; a temporary directory when None.
        dtype: float32, float16 or bfloat16; None: float32, or an ONNX file's own precision (an ONNX model
            compiles only in the precision it was exported in).
        passes: extra passes, inserted `before`/`after` a named pass (default: at the end).
        dynamic: for an nn.Module: {input name: {dim index: (symbol, min, max)}}.
        verify: verify the graph after every pass (tests turn this on).
        dump_ir: a directory to write the IR after every pass.
        tune: on a GPU, time the matmul tile candidates of every linear per token bucket against
            cuBLAS and save the choices in tuning.json (reused at load, never retuned).
        batch_invariant: tune every step of up to 64 tokens to one GEMM choice, so that where the
            generated kernel wins a sequence's sums do not depend on what shares its steps (False:
            steps of up to 4 tokens only, where int4 weights may take the GEMV kernel; faster at 8-64
            tokens per step).
        tuning_cache: reuse the choices earlier compiles timed on this GPU for the same kernels and
            shapes, and keep this compile's new ones ($LLMC_CACHE_DIR/tuning/); False: time everything.
        quant: weight quantization: a `QuantConfig`, a method name ("rtn", "gptq", "awq",
            "smoothquant", "fp8", "mixed") or a dict of QuantConfig's fields; None: none.
        draft: a draft model for speculative decoding (a local HF directory or builtin:NAME with the
            target's vocabulary), compiled with the same dtype and KV cache options into the artifact
            (`draft.llmc` inside it), where `speculative={"method": "draft"}` and `llmc run --spec
            draft` find it. It is not quantized.
        tokenizer: for an ONNX model, the directory with its tokenizer files (default: beside the file).
    Returns:
        The written Artifact.

    Example:
        >>> art = llmc.compile("builtin:tiny-py", "tiny.llmc")      # doctest: +SKIP
        >>> art.summary()["op_counts"]["attention"]                  # doctest: +SKIP
    """
    from llmc.passes.pipeline import pipeline
    from llmc.passes.quantize.config import QuantConfig
    quant = QuantConfig.coerce(quant)  # bad options fail here, before capture
    if quant is not None and quant.method == "fp8" and torch.cuda.is_available() \
            and torch.cuda.get_device_capability() < (8, 9):
        raise CompileError(f"--quant fp8: {torch.cuda.get_device_name()} has no FP8 matrix units (compute capability "
                           "8.9+: Ada, Hopper); use --quant smoothquant (int8) or rtn, or compile where the model will "
                           "run on such a GPU")
    if output is not None:
        check_output(Path(output))
    if draft is not None:
        check_draft(model, draft)
    bar = _Progress(progress)
    # kernel compiles in worker processes (LLMC_TUNE_PROCESSES): started now, their imports overlap the capture
    processes = tune_processes() if tune and torch.cuda.is_available() else 0
    workers = CompilePool(processes) if processes else contextlib.nullcontext()
    with bar, workers:
        bar.phase("capture")
        bar.step("reading the ONNX graph" if is_onnx(model) else "capturing with torch.export"
                 if isinstance(model, torch.nn.Module) else "reading the model directory")
        graph, source, tok_files = capture(model, example_inputs, dtype, dynamic, tokenizer, status=bar.step)
        if quant is not None and "qlinear" in graph.op_counts():
            raise CompileError(f"{source} holds quantized weights already (the quantization_config of its "
                               f"checkpoint): --quant {quant.method} would quantize only the layers it left dense. "
                               "Compile it without --quant, or quantize its unquantized weights")
        plist = pipeline(list(passes or []), before=before, after=after, options={**options, "quant": quant})
        if tune and torch.cuda.is_available():
            triton_setup.start()  # Triton's once-per-process set-up, beside the passes (before the tuning's threads)
        bar.phase("passes")
        bar.step(f"running {len(plist)} passes")
        ctx = PassContext(options=dict(options), state={"status": bar.step})
        if has_tokenizer(tok_files):  # generation_config.json alone is no tokenizer
            ctx.state["tokenizer_dir"] = str(tok_files[0].parent)
        graph = PassManager(plist, verify=verify, dump_dir=dump_ir,
                            progress=lambda p: bar.step(f"pass {p.name}")).run(graph, ctx)
        out = Path(output) if output is not None else Path(tempfile.mkdtemp(prefix="llmc-")) / "model.llmc"
        if dtype is None:  # an ONNX file's own precision (capture_onnx records it), float32 for the rest
            dtype = next(k for k, v in DTYPES.items() if v == torch_dtype(graph.meta.get("dtype", "f32")))
        opts = {"dtype": dtype, **{k: v for k, v in options.items() if isinstance(v, (str, int, float, bool))},
                **({"quant": quant.method} if quant is not None else {})}
        bar.phase("tuning")
        writer = ArtifactWriter(graph, out)  # the weights go to disk while the GPU tunes
        try:
            tuning = _autotune(graph, bar, batch_invariant, tuning_cache) if tune and torch.cuda.is_available() else {}
            bar.phase("write")
            bar.step(f"writing {out}")
            kernels, sources = _kernel_listing(graph, tuning)
        except BaseException:
            writer.abort()
            raise
        art = writer.finish(source, opts, tok_files, tuning=tuning, kernels=sources, kernel_list=kernels)
        art.compile_log = ctx  # fusion explanations and pass notes, for `llmc compile --explain-fusion`
        bar.phase(None)
        # seconds per phase: capture, passes, tuning (the weights file written meanwhile), write (the rest)
        art.compile_timings = bar.timings
        art.compile_steps = bar.steps
    if draft is not None:
        from llmc.artifact import DRAFT_DIR
        keep = {k: v for k, v in options.items() if k in ("kv_cache_dtype", "fuse", "paged_kv")}
        compile(draft, art.path / DRAFT_DIR, dtype=dtype, progress=progress, tune=tune,
                batch_invariant=batch_invariant, **keep)
    return art


def check_draft(model: Any, draft: str | Path) -> None:
    """A bundled draft must share the target's vocabulary (the verify step compares token ids): checked
    from both config.json files before anything is captured."""
    from llmc.frontend.hf import read_config
    if isinstance(model, torch.nn.Module) or is_onnx(model):
        raise CompileError("--draft bundles a draft with a Hugging Face target; compile the draft of an "
                           f"{'ONNX model' if is_onnx(model) else 'nn.Module'} apart")
    (tdir, _), (ddir, _) = resolve_model(model), resolve_model(draft)
    tv, dv = read_config(tdir).get("vocab_size"), read_config(ddir).get("vocab_size")
    if tv != dv:
        raise CompileError(f"the draft {draft} has a vocabulary of {dv} tokens and the target {tv}: a draft must "
                           "share the target's tokenizer")
    t, d = tdir / "tokenizer.json", ddir / "tokenizer.json"
    if t.is_file() and d.is_file() and t.read_bytes() != d.read_bytes():
        raise CompileError(f"the draft {draft} has another tokenizer (tokenizer.json differs from the target's): a "
                           "draft must share the target's tokenizer")


def check_output(out: Path) -> None:
    """Fail before capture (which takes minutes on a large model) when the artifact could not be
    written: `out` is a file, a directory holding something other than an artifact (llmc replaces an
    old artifact, never other files), or in a place this process cannot write."""
    if out.exists() and not out.is_dir():
        raise CompileError(f"the output {out} is an existing file, and an artifact is a directory; choose a new "
                           "path (NAME.llmc)")
    try:
        if out.is_dir() and not (out / MANIFEST).is_file() and any(out.iterdir()):
            raise CompileError(f"the output {out} is a non-empty directory that is not an llmc artifact; choose "
                               "a new path (NAME.llmc): llmc replaces an old artifact, never other files")
    except PermissionError:
        raise CompileError(f"the output {out} is a directory this process cannot read; choose another path") from None
    # the artifact is written next to `out` and renamed into place: its nearest existing ancestor must
    # take a new directory (tried for real: permission bits say nothing for root or read-only mounts)
    where = next(p for p in (out.absolute().parent, *out.absolute().parents) if p.exists())
    if not where.is_dir():
        raise CompileError(f"cannot write the output {out}: {where} is a file, not a directory; choose another path")
    try:
        Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=where)).rmdir()
    except OSError as e:
        raise CompileError(f"cannot write the output {out}: {where} is not writable ({e.strerror}); choose "
                           "another path") from None


def _autotune(graph: Graph, bar, batch_invariant: bool = True, cache: bool = True) -> dict:
    """Tune each distinct linear shape for decode-sized token counts (1..64) on this GPU; with `cache`,
    choices earlier compiles timed on this GPU are reused and new ones kept (autotune.cache_file)."""
    from llmc.codegen.autotune import DECODE_JOINT_BUCKETS, JOINT_BUCKETS, Tuner
    from llmc.codegen.kernels import check_counters_released
    if not graph.meta.get("paged"):
        return {}
    joint = JOINT_BUCKETS if batch_invariant else DECODE_JOINT_BUCKETS
    tuner = Tuner.persistent(joint) if cache else Tuner(joint=joint)
    _tune_kernels(graph, tuner, bar)
    try:
        budget = _measure_token_budget(graph, tuner, bar)
    except Exception as e:  # noqa: BLE001 - an optional measurement: the engine then takes 2048 tokens a step
        log.warning("measuring the token budget failed (%s: %s); the default is kept", type(e).__name__, e)
        budget = None
    check_counters_released()  # a launch that left a count behind would have skewed the timings too
    tuner.save_cache()
    out = tuner.to_json(keys=tuner.used)  # this model's choices, not the rest of the cache
    if budget is not None:
        out["token_budget"] = budget
    return out


TOKEN_BUDGET_CANDIDATES = (256, 512, 1024, 2048, 4096, 8192)
TOKEN_BUDGET_SLACK = 1.1
COPY_BYTES = 1 << 30  # the device copy that measures HBM bandwidth (read and written: 2 GiB of traffic)


def choose_token_budget(ms: dict[int, float], slack: float = TOKEN_BUDGET_SLACK) -> int:
    """The fewest tokens per step at which the step's GEMMs take at most `slack` x their best time per token
    (`ms`: milliseconds of all the model's GEMMs at M tokens). Past it a larger step gains little speed
    and only makes every decode that shares it wait longer."""
    per = {m: t / m for m, t in ms.items()}
    best = min(per.values())
    return min(m for m, p in per.items() if p <= slack * best)


def _budget_linears(graph: Graph, tuner, device: str = "cuda"):
    """Each linear shape the token budget times, one at a time (its weight made on `device` only while
    it is timed): (timing key, how many linears of the graph have it, in-features, x's dtype, a call on
    x [m, in-features]). Every linear but the LM head (which runs on the sampled rows only); a
    bf16/f16 one as cuBLAS (which runs steps past 64 tokens), a quantized one as its qlinear kernel with
    the choices `tuner` holds. A packed weight's in-features are the prepared weight's, not its codes'
    columns (two int4 codes a byte)."""
    import collections

    import torch.nn.functional as F

    from llmc.codegen import qmatmul as qmm
    vocab = int(graph.outputs[0].type.shape[-1])
    shapes: collections.Counter = collections.Counter()
    quantized: dict = {}
    for n in graph.nodes:
        if n.op in FLOAT_LINEARS:
            w = graph.weights[linear_weight_inputs(n)[0].name]
            if w.dtype in (torch.bfloat16, torch.float16) and int(w.shape[0]) != vocab:
                shapes[(int(w.shape[0]), int(w.shape[1]), w.dtype)] += 1
        elif n.op in ("qlinear", "qlinear_codes"):
            key, weights = _qlinear_tuning_key(graph, n)  # the same kernel and key as its tuning
            if key[1][0] != vocab:
                shapes[key] += 1
                quantized[key] = weights
    for shape, count in shapes.items():
        if shape in quantized:
            fmt, _, act, _, dtype = shape
            p, b = _qlinear_on(fmt, quantized[shape], device)
            N, K = p.out_features, p.in_features
            key = f"qgemm_ms:{fmt.label}:{N}x{K}:{dtype}:act={act or 'none'}:bias={int(b is not None)}"
            yield key, count, K, torch_dtype(dtype), lambda x, p=p, b=b, act=act: qmm.qlinear(x, p, b, act,
                                                                                           tuner=tuner)
            del p, b  # before the next shape's
        else:
            N, K, x_dtype = shape
            w = torch.randn(N, K, device=device).to(x_dtype)
            yield f"gemm_ms:{N}x{K}:{str(x_dtype).removeprefix('torch.')}", count, K, x_dtype, \
                lambda x, w=w: F.linear(x, w)
            del w  # before the next shape's


def _measure_token_budget(graph: Graph, tuner, bar, device: str = "cuda") -> dict | None:
    """Time every linear of the graph but the LM head at TOKEN_BUDGET_CANDIDATES tokens
    (`_budget_linears`) and choose the engine's default token budget from it (`choose_token_budget`;
    the engine reads tuning.json's "token_budget"). Each shape's times are kept in the tuning cache
    like any tile choice. None when the graph has no such linear."""
    ms = dict.fromkeys(TOKEN_BUDGET_CANDIDATES, 0.0)
    timed = False
    for key, count, K, x_dtype, run in _budget_linears(graph, tuner, device):
        if not timed:
            bar.step("measuring the step's token budget")
            timed = True
        for m in TOKEN_BUDGET_CANDIDATES:
            x = torch.randn(m, K, device=device).to(x_dtype)
            tuner.choose(key, str(m), [{}], bench=lambda cfg: run(x))
            ms[m] += count * tuner.lookup(key, str(m)).triton_ms
        del run  # its weight, before the next shape's
    if not timed:
        return None
    # the rate at which a step reads its decodes' K/V, as a device copy's bytes (read and written) per
    # second: the engine's per-step budget (config.StepBudget) costs each decode's context with it
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    tuner.choose(f"hbm_copy_ms:{COPY_BYTES}", "1", [{}], bench=lambda cfg: dst.copy_(src))
    gb_s = 2 * COPY_BYTES / tuner.lookup(f"hbm_copy_ms:{COPY_BYTES}", "1").triton_ms / 1e6
    del src, dst
    return {"tokens": choose_token_budget(ms), "slack": TOKEN_BUDGET_SLACK,
            "gemm_ms": {str(m): round(t, 4) for m, t in ms.items()}, "hbm_gb_s": round(gb_s, 1)}


def tune_shard(graph: Graph, tuning: dict) -> dict:
    """An artifact's tuning.json contents completed for `graph`, a shard of its graph (llmc/ir/sharding.py):
    a tensor-parallel rank's linears have shapes the compile never saw (N/TP rows, K/TP columns), which
    would otherwise fall back to cuBLAS or untuned tiles. Those are timed now on this GPU, once per
    machine (the tuning cache keeps them, as compiles do); the artifact's own choices stand."""
    from llmc.codegen.autotune import JOINT_BUCKETS, Tuner
    if not (torch.cuda.is_available() and graph.meta.get("paged") and tuning and tuning.get("kernels")):
        return tuning
    given = Tuner.from_json(tuning)
    if not given.records:  # measured on another GPU: its choices do not hold here, nor would ours for it
        return tuning
    tuner = Tuner.persistent(tuning.get("joint_buckets", JOINT_BUCKETS))
    tuner.records.update(given.records)
    _tune_kernels(graph, tuner, _Progress(False))
    tuner.save_cache()
    out = tuner.to_json(keys=tuner.used | set(given.records))
    out["device"] = tuning.get("device", out["device"])
    return out


def _tune_kernels(graph: Graph, tuner, bar) -> None:
    _tune_linears(graph, tuner, bar)
    try:
        _tune_attention(graph, tuner, bar)
    except Exception as e:  # noqa: BLE001 - an optional choice: the kernel's defaults still run
        log.warning("attention tuning failed (%s: %s); the default launch is kept", type(e).__name__, e)


# the decode attention tuning's two steps: batch 1 over 512 keys and 64 sequences over 1,024. On an H200
# (benchmarks/attention_bench.py, 2026-12-04) the launch they choose for the 8B shape (128-key tiles, 8 warps) runs
# a mixed workload's decode step of 128 ragged contexts 1.12x slower than 32- or 64-key tiles on 4 warps, which
# lose 1.5-4 us of 8-10 at batch 1; a tuning that timed that step in place of 64 x 1,024 chose 32-key tiles, and the
# 8B batch-1 decode measured 207 tok/s with them (221 on the machine before), so batch 1 keeps its weight here
DECODE_TUNING_CONTEXTS = ([512], [1024] * 64)
# among decode launches timed within this fraction of the fastest on those steps, the one of fewest warps is
# chosen: on an H100 (benchmarks/decode_launch_lab.py, 2026-12-07) 64-key tiles on 4 warps came within 0.1-0.6%
# of 128-key tiles on 8 warps there, and the 8B int4 decode ran batch 16 1.085x faster with them and batch 1
# within 0.5%; with PDL off the two ran batch 16 alike, so the gain is in how the attention overlaps the launch of
# the kernel after it, which a timing of the attention alone cannot see
DECODE_LIGHTER_WITHIN = 0.02


def decode_launch_weight(cfg: dict) -> int:
    """A decode attention launch's weight for the tuning's choice among launches timed alike: its warps."""
    return cfg["num_warps"]


def _tune_attention(graph: Graph, tuner, bar, device: str = "cuda") -> None:
    """Choose the attention launches of each attention shape of the graph. One choice serves every batch, so a
    sequence's sums do not depend on its batch.

    - decode (key tile, pipeline depth, warps: attention.DECODE_TILE_CANDIDATES; over an int8 / fp8 cache too,
      in blocks of the runtime's default size), timed on two steps summed
      (DECODE_TUNING_CONTEXTS): one sequence of 512 keys (batch-1 decode) and 64 of 1,024 (a large batch),
      with the splits the runtime's CUDA graphs use; of the launches within DECODE_LIGHTER_WITHIN of the
      fastest, the one of fewest warps;
    - prefill (query and key tiles, depth, warps: attention.PREFILL_TILE_CANDIDATES), timed on a fresh
      2,048-token prompt plus four 512-token chunks over 1,024 keys (a mixed step's decodes run on the
      decode kernel; over a quantized cache the prefill keeps its default launch)."""
    from llmc.codegen.attention import DECODE_TILE_CANDIDATES, DTYPES, PREFILL_TILE_CANDIDATES, QUANTIZED
    from llmc.codegen.lower import _tname, attention_tiles_key_of, attention_types
    max_len = int(graph.meta.get("max_position_embeddings") or 4096)
    seen = set()
    for n in graph.nodes:
        if n.op not in ("attend_paged", "paged_attention"):
            continue
        q, cache = attention_types(n)
        D, Hq, Hkv = int(q.shape[3]), int(q.shape[1]), int(cache.shape[3])
        qd, kd = _tname(q.dtype), _tname(cache.dtype)
        key = attention_tiles_key_of(n)
        quantized = kd in QUANTIZED and qd in ("float16", "bfloat16")
        if key in seen or not (quantized or kd in ("float16", "bfloat16", "float32") and qd == kd):
            continue
        seen.add(key)
        bar.step(f"tuning attention ({Hq} heads over {Hkv}, {D} wide)")
        dtype, window = getattr(torch, qd), int(n.attrs["window"])
        g = torch.Generator(device=device).manual_seed(0)
        decode = _decode_steps(g, DECODE_TUNING_CONTEXTS, Hq, Hkv, D, dtype, DTYPES[kd], max_len, device)
        tuner.choose(key, "decode", DECODE_TILE_CANDIDATES, lambda cfg: _attend(decode, D, window, decode_tiles=cfg),
                     lighter=decode_launch_weight, within=DECODE_LIGHTER_WITHIN)
        del decode
        if quantized:
            continue
        prefill = [(_attention_step(g, new, ctx, Hq, Hkv, D, dtype, device=device), (new, ctx))
                   for new, ctx in (([2048], [2048]), ([512] * 4, [1024] * 4))]
        tuner.choose(attention_tiles_key_of(n, "prefill"), "prefill", PREFILL_TILE_CANDIDATES,
                     lambda cfg: _attend(prefill, D, window, prefill_tiles=cfg))
        del prefill


def _attend(steps, D: int, window: int, **kw) -> None:
    """Run paged attention over each of `steps` (`_attention_step`'s inputs, then the step's (new, ctx) lengths):
    the lengths given, so no host sync, and a tuner times the steps as a CUDA graph."""
    from llmc.codegen.attention import paged_attention
    for (qq, kv, scale, qsl, lens, tables, out), (new, ctx) in steps:
        paged_attention(qq, kv, qsl, lens, tables, D ** -0.5, True, window, scale, out=out,
                        max_seqlen_q=max(new), max_seqlen_k=max(ctx), **kw)


def _decode_steps(g, contexts, Hq: int, Hkv: int, D: int, dtype, kv_dtype, max_len: int,
                  device: str = "cuda") -> list:
    """Decode steps for `_attend`, one per list of `contexts` (a sequence's keys each, one new token each),
    within the model's limit `max_len`, which sizes the splits as under the runtime's graphs."""
    return [(_attention_step(g, [1] * len(ctx), [min(c, max_len) for c in ctx], Hq, Hkv, D, dtype,
                             kv_dtype=kv_dtype, device=device), ([1], [max_len]))
            for ctx in contexts]


def _attention_step(g, new: list[int], ctx: list[int], Hq: int, Hkv: int, D: int, dtype, bs: int = 16,
                    kv_dtype=None, layout: str | None = None, device: str = "cuda") -> tuple:
    """One attention step's inputs on `device` (`g`'s): sequence i has `new[i]` new tokens at the end of
    `ctx[i]` keys (q, kv_cache, kv_scale, query_start_loc, seq_lens, block_tables, out), its blocks scattered
    over a cache in the memory order `layout` (default: the one the runtime allocates, `kv_cache.kv_layout`). An
    int8 / fp8 `kv_dtype` gives random codes and a kv_scale of random centres and positive per-token scales (the
    speed does not depend on their values); else the cache holds `dtype` and kv_scale is None."""
    from llmc.runtime.kv_cache import empty_cache, kv_layout
    per = max(-(-c // bs) for c in ctx)
    seqs, T = len(new), sum(new)
    shape = (2, seqs * per + 1, bs, Hkv, D)
    kv_dtype = kv_dtype or dtype
    kv = empty_cache(shape, kv_dtype, device, kv_layout(layout))
    codes = torch.randn(shape, device=device, generator=g)
    kv.copy_(codes.mul(20).clamp(-127, 127).round() if kv_dtype == torch.int8 else codes)
    scale = None  # [NB, Hkv, 2D + 2BS]: K and V centres, then K and V per-token scales (ir/paged_attention.py)
    if kv_dtype != dtype:
        scale = torch.rand(shape[1], Hkv, 2 * D + 2 * bs, device=device, generator=g).mul(0.01).to(dtype)
    tables = torch.randperm(seqs * per, device=device, generator=g).to(torch.int32).view(seqs, per)
    qsl = torch.tensor([0, *itertools.accumulate(new)], device=device, dtype=torch.int32)
    return (torch.randn(T, Hq, D, device=device, generator=g).to(dtype), kv, scale, qsl,
            torch.tensor(ctx, device=device, dtype=torch.int32), tables,
            torch.empty(T, Hq, D, device=device, dtype=dtype))


def _tune_linears(graph: Graph, tuner, bar, device: str = "cuda") -> None:
    """Tune each distinct bf16/f16/f32 linear at the decode buckets (and each quantized one, `_tune_qlinear`).
    First every linear runs once per bucket on threads with the choices already recorded (earlier compiles'
    cache, the shipped tables; defaults where none is), so their kernels compile in parallel; then each is
    tuned in turn, timing only what no record holds."""
    from llmc.codegen import matmul as mm
    from llmc.codegen.autotune import M_BUCKETS, Tuner, run_on_threads
    from llmc.codegen.lower import ACT_EPILOGUE
    seen: set = set()
    # (weight on the device, bias, epilogue, whether the SwiGLU product is its prologue, or its epilogue)
    linears = []
    for n in graph.nodes:
        if n.op in ("qlinear", "qlinear_codes"):
            _tune_qlinear(graph, n, tuner, seen, bar, device)
        if n.op not in FLOAT_LINEARS:
            continue
        wv, bv = linear_weight_inputs(n)
        w = graph.weights[wv.name]
        b = graph.weights[bv.name].to(device) if bv is not None else None
        epi = ACT_EPILOGUE[n.attrs["act"]] if n.op == "linear_act" else ()
        pro, gated = n.op == "silu_mul_linear", n.op == "linear_silu_mul"
        key = (tuple(w.shape), w.dtype, b is not None, epi, pro, gated)
        if key not in seen:
            seen.add(key)
            linears.append((w.to(device), b, epi, pro, gated))
    if not linears:
        return
    # x [m, K], or gate and up as the halves of one [m, 2K] (a fused gate/up projection's output)
    xs = {(m, k, dt, pro): torch.randn(m, 2 * k if pro else k, dtype=dt, device=device)
          for m in M_BUCKETS[:-1] for k, dt, pro in {(int(w.shape[1]), w.dtype, pro) for w, _, _, pro, _ in linears}}

    def call(w, b, epi, pro, gated, m, tuner):
        K, x = int(w.shape[1]), xs[(m, int(w.shape[1]), w.dtype, pro)]
        return mm.linear(x[:, :K], w, b, epi, tuner=tuner, up=x[:, K:] if pro else None, gated=gated)
    if isinstance(tuner, Tuner):
        recorded = Tuner(tuner.records, tuner.device, frozen=True, joint=tuner.joint)
        bar.step(f"compiling the recorded choices of {len(linears)} linear shapes")
        run_on_threads([functools.partial(call, *lin, m, recorded) for lin in linears for m in M_BUCKETS[:-1]],
                       shared_kernels=True)
    for lin in linears:
        bar.step(f"tuning linear {list(lin[0].shape)}" + (" (SwiGLU prologue)" if lin[3] else "")
                 + (" (SwiGLU epilogue)" if lin[4] else ""))
        for m in M_BUCKETS[:-1]:
            call(*lin, m, tuner)


def _tune_qlinear(graph: Graph, n, tuner, seen: set, bar, device: str = "cuda") -> None:
    """Tune a quantized linear's kernel per token bucket (its key holds the format and shape): unlike a
    bf16 linear, which hands steps past 64 tokens to cuBLAS, every bucket runs a choice of its own.
    A `qlinear_codes` node (its activation codes made by the norm or SwiGLU before it, fuse_act_quant)
    runs the same kernel under the same key as a qlinear of float x in its output dtype: it is timed as
    that."""
    from llmc.codegen import qmatmul as qmm
    key, weights = _qlinear_tuning_key(graph, n)
    if key in seen:
        return
    seen.add(key)
    fmt, shape, act, _, dtype = key
    bar.step(f"tuning {fmt.label} linear {list(shape)}")
    p, b = _qlinear_on(fmt, weights, device)
    for m in qmm.TUNED_ROWS:
        x = torch.randn(m, p.in_features, dtype=torch_dtype(dtype), device=device)
        qmm.qlinear(x, p, b, act, tuner=tuner)


def _qlinear_tuning_key(graph: Graph, n) -> tuple[tuple, tuple]:
    """A quantized linear's tuning identity (format, weight shape, act, has bias, x's dtype name: a
    `qlinear_codes` node counts as a qlinear of float x in its output dtype) and its weight operands
    (qweight, scales, zeros or None, bias or None)."""
    from llmc.ir.ops import qlinear_weight_inputs
    from llmc.ir.quant import QuantFormat
    weights = tuple(graph.weights[v.name] if v is not None else None for v in qlinear_weight_inputs(n))
    dtype = n.attrs["dtype"] if n.op == "qlinear_codes" else n.inputs[0].type.dtype
    key = (QuantFormat.from_attrs(n.attrs), tuple(int(d) for d in weights[0].shape), n.attrs["act"],
           weights[3] is not None, dtype)
    return key, weights


def _qlinear_on(fmt, weights: tuple, device: str):
    """A quantized linear's weight prepared for its kernel on `device`, and its bias there (or None)."""
    from llmc.codegen import qmatmul as qmm
    qw, sc, zeros, bias = weights
    p = qmm.prepare(fmt, qw.to(device), sc.to(device), zeros.to(device) if zeros is not None else None)
    return p, bias.to(device) if bias is not None else None


def _kernel_listing(graph: Graph, tuning: dict | None = None) -> tuple[list[dict], dict[str, str]]:
    """What each node of a paged graph lowers to on the kernel backends, and the rendered sources
    (for reading: the runtime re-renders from its own templates and never loads these)."""
    if not graph.meta.get("paged"):
        return [], {}
    from llmc.codegen.lower import Plan
    from llmc.codegen.autotune import Tuner
    plan = Plan(graph, "meta", Tuner.from_artifact(tuning))
    listing, sources, by_node = plan.kernels(), {}, {}
    for st, label, src in plan.sources():
        by_node.setdefault(id(st.node), []).append(label)
        sources[label.split(":", 1)[0]] = src
    for row, st in zip(listing, plan.steps):
        row["sources"] = by_node.get(id(st.node), [])
    return listing, sources


class _Progress:
    """A rich spinner with the current compile step, or nothing when not on a terminal / not asked; it
    also times the compile's phases (`timings`: seconds per phase name, in the order first entered) and
    its steps (`steps`: (step message, seconds until the next step or phase), in order)."""

    def __init__(self, enabled: bool):
        self.enabled, self._p, self._t = enabled, None, None
        self.timings: dict[str, float] = {}
        self.steps: list[tuple[str, float]] = []
        self._phase: tuple[str, float] | None = None
        self._step: tuple[str, float] | None = None

    def _end_step(self, now: float) -> None:
        if self._step is not None:
            self.steps.append((self._step[0], now - self._step[1]))
            self._step = None

    def phase(self, name: str | None) -> None:
        """End the current phase (its time is added to `timings`) and start `name` (None: none)."""
        now = time.perf_counter()
        self._end_step(now)
        if self._phase is not None:
            last, since = self._phase
            self.timings[last] = self.timings.get(last, 0.0) + now - since
        self._phase = (name, now) if name is not None else None

    def __enter__(self):
        if self.enabled:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
            self._p = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True)
            self._p.__enter__()
            self._t = self._p.add_task("compiling", total=None)
        return self

    def step(self, msg: str) -> None:
        now = time.perf_counter()
        self._end_step(now)
        self._step = (msg, now)
        if self._p:
            self._p.update(self._t, description=msg)

    def __exit__(self, *exc):
        if self._p:
            self._p.__exit__(*exc)
        return False
