"""The artifact: a directory holding the lowered graph, its weights, tuning choices and tokenizer.

    NAME.llmc/
      manifest.json      format version, llmc version, source model, options, sha256 of every file
      graph.json         the lowered IR
      weights.safetensors
      tuning.json        autotune choices per kernel and device
      tokenizer/         the tokenizer files
      kernels/           rendered kernel sources, for reading only

No pickle anywhere, and nothing in an artifact is ever imported or executed: the runtime re-renders
kernels from the IR with its own templates.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmc.errors import ArtifactError, IRError
from llmc.ir.graph import Graph, WeightStore
from llmc.ir.kv_layout import kv_cache_inputs, kv_model_dtype
from llmc.ir.serialize import graph_from_dict, graph_to_dict

# Bumped on every change of the artifact layout: 2 added the typed model info; 3 gives a file recorded in
# pieces the digest of its pieces (`pieces_digest`) instead of its whole sha256. This llmc reads both.
FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)
DRAFT_DIR = "draft.llmc"  # a draft model's artifact, bundled inside its target's
MANIFEST = "manifest.json"
# the files without one of which a model directory has no tokenizer (generation_config.json alone is none)
TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(files) -> bool:
    """Whether a model's files (paths) include a tokenizer: one of `TOKENIZER_CORE`."""
    return any(Path(f).name in TOKENIZER_CORE for f in files)


@dataclass(frozen=True)
class ModelInfo:
    """What the runtime needs to know of a compiled model, written by compile and read by run.

    Every field is plain JSON data; `kv_cache_dtype` is the compiled default, which the runtime may
    override at load (with block size and number of blocks, a parameter of the plan).
    """

    architecture: str
    vocab_size: int
    max_model_len: int
    num_layers: int  # layers with a KV cache
    num_heads: int | None
    num_kv_heads: int
    head_dim: int
    dtype: str  # IR dtype of the KV cache entries before quantization (the model's activations)
    kv_cache_dtype: str  # auto, int8 or fp8
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    chat_template: str | None = None

    @classmethod
    def from_graph(cls, graph: Graph, tokenizer_files: list[Path] | None = None) -> "ModelInfo":
        """Read the model's shape off a paged graph (and the frontend's notes in `graph.meta`)."""
        meta = graph.meta
        caches = kv_cache_inputs(graph)
        if not caches:
            raise ArtifactError("the graph has no KV cache inputs: compile with the paged_kv pass (the default "
                                "pipeline) to produce a runnable artifact")
        _, _, _, kv_heads, head_dim = caches[0].type.shape
        vocab = graph.outputs[0].type.shape[-1]
        model_dtype = kv_model_dtype(caches[0], graph.users())
        eos = meta.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
        return cls(
            architecture=str(meta.get("architecture") or meta.get("name") or "module"),
            vocab_size=int(meta.get("vocab_size") or vocab),
            max_model_len=int(meta.get("max_position_embeddings") or 2048),
            num_layers=len(caches),
            num_heads=meta.get("num_attention_heads"),
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            dtype=str(model_dtype),
            kv_cache_dtype=str(meta.get("kv_cache_dtype", "auto")),
            eos_token_ids=eos_ids,
            bos_token_id=meta.get("bos_token_id"),
            chat_template=_chat_template(tokenizer_files or []),
        )

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelInfo":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(d) - {"bos_token_id", "chat_template", "eos_token_ids", "num_heads"}
        if missing:
            raise ArtifactError(f"the manifest's model info lacks {sorted(missing)}; recompile the artifact")
        kw = {k: v for k, v in d.items() if k in names}
        kw["eos_token_ids"] = tuple(kw.get("eos_token_ids") or ())
        return cls(**kw)


def _chat_template(files: list[Path]) -> str | None:
    """The tokenizer's chat template: chat_template.jinja, else tokenizer_config.json's field."""
    by_name = {f.name: f for f in files}
    if "chat_template.jinja" in by_name:
        return by_name["chat_template.jinja"].read_text()
    if "tokenizer_config.json" in by_name:
        try:
            tpl = json.loads(by_name["tokenizer_config.json"].read_text()).get("chat_template")
        except (json.JSONDecodeError, OSError):
            return None
        return tpl if isinstance(tpl, str) else None
    return None


HASH_CHUNK = 1 << 26  # bytes per separately hashed piece of a large file (manifest "chunks")
_READ = 1 << 22


def sha256_file(path: Path) -> str:
    return _sha256_range(path)


def hash_pieces(path: Path, chunk_bytes: int | None = None, threads: int | None = None) -> list[str]:
    """sha256 of each `chunk_bytes` piece of a file (default HASH_CHUNK), on `threads` threads (default: one
    per core): what a compile records for a large file and a load checks (`verify_files`)."""
    chunk_bytes = chunk_bytes or HASH_CHUNK
    n = max(1, -(-path.stat().st_size // chunk_bytes))
    return _hash_ranges([(path, i * chunk_bytes, chunk_bytes) for i in range(n)], threads)


def _hash_ranges(ranges: list[tuple[Path, int, int | None]], threads: int | None = None) -> list[str]:
    """sha256 of each (path, offset, size) range (`_sha256_range`), on `threads` threads (default: one per core)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max(1, min(len(ranges), threads or os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda r: _sha256_range(*r), ranges))


def _pieces_if_large(path: Path) -> list[str]:
    """A file past HASH_CHUNK is recorded in pieces (`hash_pieces`); [] for a smaller one (hashed whole)."""
    return hash_pieces(path) if path.stat().st_size > HASH_CHUNK else []


_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
              "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
              "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32", "uint64": "U64"}
_WRITE = 1 << 30  # the most bytes one pwrite is given (Linux writes at most ~2 GiB a call)


def write_safetensors(tensors: dict[str, Any], path: Path, threads: int | None = None) -> list[str]:
    """Write CPU tensors as a safetensors file and return the sha256 of each HASH_CHUNK piece of it (what
    `hash_pieces` would read back), on `threads` threads (default: one per core, at most 16).

    The file is the documented format: an 8-byte little-endian header length, a JSON header giving each
    tensor's dtype, shape and byte range, padded with spaces to a multiple of 8, then the tensors' bytes
    back to back (here in name order). Each piece is hashed from the tensors' own memory and written with
    pwrite by one thread (hashlib and pwrite release the GIL), so the bytes are neither copied into one
    buffer first nor read back to be hashed.
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch
    header, segments, end = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        kind = str(t.dtype).removeprefix("torch.")
        if kind not in _ST_DTYPES:
            raise ArtifactError(f"weight {name} has dtype {t.dtype}, which a safetensors file cannot hold")
        data = memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        header[name] = {"dtype": _ST_DTYPES[kind], "shape": list(t.shape), "data_offsets": [end, end + len(data)]}
        segments.append((end, data))
        end += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    base = 8 + len(head)
    segments = [(0, memoryview(len(head).to_bytes(8, "little") + head))] + [(base + o, d) for o, d in segments]
    size = base + end
    pieces: list[list[tuple[int, memoryview]]] = [[] for _ in range(max(1, -(-size // HASH_CHUNK)))]
    for start, data in segments:  # each segment cut at the pieces' boundaries
        at = 0
        while at < len(data):
            i = (start + at) // HASH_CHUNK
            n = min(len(data) - at, (i + 1) * HASH_CHUNK - start - at)
            pieces[i].append((start + at, data[at:at + n]))
            at += n
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)

        def write_piece(parts: list[tuple[int, memoryview]]) -> str:
            h = hashlib.sha256()
            for offset, data in parts:
                h.update(data)
                while len(data):
                    done = os.pwrite(fd, data[:_WRITE], offset)
                    data, offset = data[done:], offset + done
            return h.hexdigest()

        with ThreadPoolExecutor(max(1, min(len(pieces), threads or min(os.cpu_count() or 1, 16)))) as pool:
            return list(pool.map(write_piece, pieces))
    finally:
        os.close(fd)


def pieces_digest(pieces: list[str]) -> str:
    """A file recorded in pieces has this digest in the manifest's "files": the sha256 of its pieces' hex
    digests, one per line. (A whole-file sha256 would take one core a pass over the file, ~8 s for an 8B
    model's 16 GB, where the pieces take every core.)"""
    return hashlib.sha256("\n".join(pieces).encode()).hexdigest()


def _sha256_range(path: Path, offset: int = 0, size: int | None = None) -> str:
    """sha256 of `size` bytes of `path` from `offset` (None: to its end). hashlib and the reads release the
    GIL: threads run it in parallel."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        end = os.fstat(fd).st_size if size is None else offset + size
        while offset < end:
            block = os.pread(fd, min(_READ, end - offset), offset)
            if not block:
                break
            h.update(block)
            offset += len(block)
    finally:
        os.close(fd)
    return h.hexdigest()


@dataclass
class Artifact:
    """A loaded (or just written) artifact: its path, manifest and graph with weights attached."""

    path: Path
    manifest: dict[str, Any]
    graph: Graph
    tuning: dict[str, Any] = field(default_factory=dict)
    compile_log: Any = None
    compile_timings: dict[str, float] = field(default_factory=dict)  # seconds per compile phase (compile's)
    weights_seconds: float | None = None  # compile's: writing and hashing the weights file, beside the tuning
    compile_steps: list = field(default_factory=list)  # compile's: (step, seconds) in order, within the phases
    verifying: Any = None  # the check of its files, still running (load_artifact(..., verify="background"))

    def wait_verified(self) -> None:
        """Wait for the check of the files that `load_artifact(..., verify="background")` started, and raise its
        ArtifactError if a file differs from the manifest; nothing if none is running."""
        check, self.verifying = self.verifying, None
        if check is not None:
            check.result()

    @property
    def info(self) -> ModelInfo:
        """The model's shape, vocabulary, context and tokens (only runnable, paged artifacts have it)."""
        d = self.manifest.get("model_info")
        if d is None:
            raise ArtifactError(f"artifact {self.path} was compiled without the paged_kv pass, so it cannot run; "
                                "recompile it with the default pipeline")
        return ModelInfo.from_json(d)

    @property
    def bundled_draft(self) -> Path | None:
        """The draft model compiled into this artifact (`llmc compile TARGET --draft DRAFT`), if any."""
        d = self.path / DRAFT_DIR
        return d if (d / MANIFEST).is_file() else None

    @property
    def tokenizer_dir(self) -> Path | None:
        """The copied tokenizer files, or None when the source model had no tokenizer."""
        d = self.path / "tokenizer"
        found = any((d / f).is_file() for f in TOKENIZER_CORE)
        if not found:
            listed = [f for f in (self.manifest.get("files") or {}) if f.startswith("tokenizer/")]
            lost = next((f for f in listed if not (self.path / f).is_file()), None)
            if lost is not None:  # written with a tokenizer that is gone since: a damaged artifact, not a bare model
                raise ArtifactError(f"artifact {self.path} is missing {lost}; recompile it")
        return d if found else None

    def tokenizer(self):
        """The artifact's tokenizer over the copied files (llmc/tokenizer.py: the Rust tokenizers library where
        that is all transformers would run, else transformers' AutoTokenizer)."""
        if self.tokenizer_dir is None:
            raise ArtifactError(f"artifact {self.path} has no tokenizer; compile from a model directory "
                                "that holds tokenizer files, or pass token ids")
        from llmc.tokenizer import load_tokenizer
        return load_tokenizer(self.tokenizer_dir)

    @property
    def passes(self) -> list[str]:
        return [p["name"] for p in self.manifest.get("passes", [])]

    def summary(self) -> dict[str, Any]:
        g = self.graph
        return {
            "path": str(self.path),
            "format_version": self.manifest["format_version"],
            "llmc_version": self.manifest.get("llmc_version"),
            "created": self.manifest.get("created"),
            "source": self.manifest.get("source"),
            "options": self.manifest.get("options", {}),
            "passes": self.passes,
            "op_counts": g.op_counts(),
            "param_bytes_by_dtype": g.weights.bytes_by_dtype(),
            "num_params": sum(t.numel() for t in g.weights.tensors.values()),
            "token_budget": (self.tuning or {}).get("token_budget"),  # measured at compile (compiler.py)
        }


def save_artifact(graph: Graph, out: str | Path, source: str, options: dict[str, Any],
                  tokenizer_files: list[Path] | None = None, tuning: dict | None = None,
                  kernels: dict[str, str] | None = None, kernel_list: list[dict] | None = None) -> Artifact:
    """Write `graph` and its weights as an artifact directory (replacing an existing artifact there)."""
    return ArtifactWriter(graph, out).finish(source, options, tokenizer_files, tuning, kernels, kernel_list)


class ArtifactWriter:
    """An artifact written in two steps, so that its weights (nearly all of its bytes) go to disk while
    the compile tunes kernels on the GPU: creating the writer starts writing and hashing the weights in
    a thread (safetensors and hashlib release the GIL); `finish` adds the rest once the tuning is
    known and puts the artifact in place whole, or `abort` removes what was written.

    Example:
        >>> w = ArtifactWriter(graph, "m.llmc")                      # doctest: +SKIP
        >>> art = w.finish("builtin:tiny-py", {"dtype": "float32"})  # doctest: +SKIP
    """

    WEIGHTS = "weights.safetensors"
    # the weights file's threads ($LLMC_WRITE_THREADS; default one per core, at most 16). It is written while
    # the tuning compiles kernels, and with a matching tuning table it is what a cold compile waits for last:
    # cold 8B compiles on an H200 host of 16 cores wrote it in 5.2 s with 16 threads against 5.8-7.7 s with 4,
    # and compiled their kernels in the same 1.9-2.0 s (benchmarks/RESULTS.md, 2026-12-02)
    MAX_WRITE_THREADS = 16

    @classmethod
    def write_threads(cls) -> int:
        v = os.environ.get("LLMC_WRITE_THREADS", "")
        return max(1, int(v)) if v.strip().isdigit() else min(cls.MAX_WRITE_THREADS, os.cpu_count() or 1)

    def __init__(self, graph: Graph, out: str | Path):
        from concurrent.futures import ThreadPoolExecutor
        self.graph, self.out = graph, Path(out)
        if self.out.exists() and not (self.out / MANIFEST).exists() and any(self.out.iterdir()):
            raise ArtifactError(f"{self.out} exists and is not an llmc artifact; choose another output path")
        self.tmp = self.out.with_name(self.out.name + ".partial")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.seconds: float | None = None  # the weights file's write, once done
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llmc-write")
        self._weights = self._pool.submit(self._write_weights)

    def _write_weights(self) -> list[str]:
        """Write the weights file; its pieces' sha256 (`hash_pieces`) if it is large, else []. Its seconds
        go to `seconds` (it runs beside the tuning, so the compile's phases do not show it)."""
        import time
        start = time.perf_counter()
        pieces = write_safetensors({p.name: self.graph.weights[p.name] for p in self.graph.params},
                                   self.tmp / self.WEIGHTS, threads=self.write_threads())
        self.seconds = time.perf_counter() - start
        return pieces if len(pieces) > 1 else []

    def finish(self, source: str, options: dict[str, Any], tokenizer_files: list[Path] | None = None,
               tuning: dict | None = None, kernels: dict[str, str] | None = None,
               kernel_list: list[dict] | None = None) -> Artifact:
        """The rest of the artifact (graph, tuning, tokenizer, kernel sources, manifest), once the weights
        are written; the artifact then replaces `out` at once. Raises what writing the weights raised."""
        from llmc import __version__
        try:
            weight_pieces = self._weights.result()
            graph, tmp = self.graph, self.tmp
            info = ModelInfo.from_graph(graph, tokenizer_files) if graph.meta.get("paged") else None
            (tmp / "graph.json").write_text(json.dumps(graph_to_dict(graph), indent=1))
            (tmp / "tuning.json").write_text(json.dumps(tuning or {}, indent=1))
            (tmp / "tokenizer").mkdir()
            for f in tokenizer_files or []:
                shutil.copy2(f, tmp / "tokenizer" / f.name)
            (tmp / "kernels").mkdir()
            for name, src in (kernels or {}).items():
                (tmp / "kernels" / name).write_text(src)
            files, chunks = {}, {}
            for p in sorted(tmp.rglob("*")):
                if p.is_file():
                    rel = str(p.relative_to(tmp))
                    pieces = weight_pieces if rel == self.WEIGHTS else _pieces_if_large(p)
                    if pieces:
                        files[rel], chunks[rel] = pieces_digest(pieces), {"bytes": HASH_CHUNK, "sha256": pieces}
                    else:
                        files[rel] = sha256_file(p)
            manifest = {
                "format_version": FORMAT_VERSION,
                "llmc_version": __version__,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "source": source,
                "options": options,
                "passes": graph.meta.get("passes", []),
                "model": {k: v for k, v in graph.meta.items() if k != "passes"},
                "model_info": info.to_json() if info else None,
                "kernels": kernel_list or [],
                "files": files,
                "chunks": chunks,  # large files' pieces: what a load checks, in parallel (verify_files)
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if self.out.exists():
                shutil.rmtree(self.out)
            tmp.rename(self.out)  # the artifact appears whole or not at all
        except BaseException:
            self.abort()
            raise
        self._pool.shutdown()
        return Artifact(self.out, manifest, graph, tuning or {}, weights_seconds=self.seconds)

    def abort(self) -> None:
        """Stop (after the weights file in progress) and remove what was written; `out` is left as it was."""
        self._weights.cancel()
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the artifact at `path`, after checking that it is one of this format version."""
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path} does not exist; compile a model into it first (`llmc compile MODEL -o {path}`)")
    if not path.is_dir() or not (path / MANIFEST).is_file():
        raise ArtifactError(f"{path} is not an llmc artifact (no {MANIFEST}); create one with `llmc compile`")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path / MANIFEST} is not valid JSON: {e}") from None
    version = manifest.get("format_version")
    if version not in READ_VERSIONS:
        from llmc import __version__
        made_by = manifest.get("llmc_version", "an unknown version")
        raise ArtifactError(f"artifact {path} has format version {version!r} (written by llmc {made_by}); this llmc "
                            f"{__version__} reads format versions {READ_VERSIONS[0]} to {FORMAT_VERSION}: recompile "
                            f"the model with llmc {__version__} (`llmc compile MODEL -o {path}`)")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], threads: int | None = None) -> None:
    """Check every file against its recorded sha256; raise naming the first that differs.

    A file the manifest records in pieces ("chunks": the weights of any real model) is checked piece by
    piece on `threads` threads (default: one per core), so a load reads and hashes it at the machine's
    memory bandwidth rather than one core's hashing speed; its size must also match. Others, and
    artifacts written before pieces were recorded, are hashed whole."""
    chunked = manifest.get("chunks", {})
    jobs = []  # (rel, offset, size, digest)
    for rel, digest in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            raise ArtifactError(f"artifact {path} is missing {rel}; recompile it")
        c = chunked.get(rel)
        if c is None:
            jobs.append((rel, 0, None, digest))
            continue
        n, size = len(c["sha256"]), f.stat().st_size
        whole_digest = manifest.get("format_version") == 2  # v2 recorded the whole file's sha256 beside its pieces
        if not whole_digest and digest != pieces_digest(c["sha256"]):
            raise ArtifactError(f"artifact {path}'s manifest is corrupted (the pieces of {rel} do not give its "
                                "digest); recompile the artifact or restore manifest.json")
        if not (n - 1) * c["bytes"] < size <= n * c["bytes"]:
            raise ArtifactError(f"artifact file {rel} is corrupted (its size, {size} bytes, does not match the "
                                "manifest); recompile the artifact or restore the file")
        jobs += [(rel, i * c["bytes"], c["bytes"], d) for i, d in enumerate(c["sha256"])]

    got = _hash_ranges([(path / rel, offset, size) for rel, offset, size, _ in jobs], threads)
    bad = next((rel for (rel, *_, digest), g in zip(jobs, got) if g != digest), None)
    if bad is not None:
        raise ArtifactError(f"artifact file {bad} is corrupted (sha256 mismatch with the manifest); "
                            "recompile the artifact or restore the file")


def load_artifact(path: str | Path, verify: bool | str = True) -> Artifact:
    """Load an artifact: check its format version and file hashes, read the graph and weights, and
    check that every weight has the shape and dtype that graph.json declares for it.

    `verify="background"` checks the hashes on threads of their own while the rest loads and the caller
    moves the weights to the device (an engine does so: the two reads of the file overlap); the caller then
    calls `Artifact.wait_verified()` before it runs anything on them, which raises as a check here would.

    An op that no loaded code registers (one a user's pass added) is an error naming the op: llmc
    never imports code from an artifact, so the user imports the file that defines it first
    (`--plugin FILE.py` on the command line).
    """
    from safetensors.torch import load_file
    path = Path(path)
    manifest = read_manifest(path)
    check = None
    if verify == "background":
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(1, thread_name_prefix="llmc-verify")
        # a core or two left to the caller, who reads the weights meanwhile
        check = pool.submit(verify_files, path, manifest, max(1, (os.cpu_count() or 1) - 2))
        pool.shutdown(wait=False)  # the check runs on; its thread ends with it
    elif verify:
        verify_files(path, manifest)
    try:
        graph = graph_from_dict(json.loads((path / "graph.json").read_text()))
    except IRError as e:
        raise ArtifactError(f"artifact {path}: {e}") from None
    except (KeyError, TypeError, OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"artifact {path}: graph.json cannot be read ({type(e).__name__}: {e}); "
                            "recompile the artifact") from None
    try:
        graph.weights = WeightStore(load_file(str(path / "weights.safetensors")))
    except Exception as e:  # safetensors raises its own (Rust) error type, or OSError for a missing file
        raise ArtifactError(f"artifact {path}: weights.safetensors cannot be read ({e}); recompile the "
                            "artifact") from None
    missing = [p.name for p in graph.params if p.name not in graph.weights]
    if missing:
        raise ArtifactError(f"artifact {path}: weights for {missing[:3]} are missing; recompile the artifact")
    _check_param_types(path, graph)
    tuning = json.loads((path / "tuning.json").read_text()) if (path / "tuning.json").exists() else {}
    return Artifact(path, manifest, graph, tuning, verifying=check)


def _check_param_types(path: Path, graph: Graph) -> None:
    """Each weight against its declared type: a graph.json and weights.safetensors that do not belong
    together (hand-edited, or copied from two compiles) would otherwise fail deep inside a kernel."""
    from llmc.ir.types import DTYPE_NAMES, torch_dtype
    for p in graph.params:
        t, want = graph.weights[p.name], p.type
        shape_ok = t.dim() == len(want.shape) and all(not isinstance(d, int) or d == n
                                                       for d, n in zip(want.shape, t.shape))
        if not shape_ok or torch_dtype(want.dtype) != t.dtype:
            got = f"{DTYPE_NAMES.get(t.dtype, t.dtype)}[{','.join(map(str, t.shape))}]"
            raise ArtifactError(f"artifact {path}: parameter {p.name} is declared {want} in graph.json but "
                                f"weights.safetensors holds {got}; the files do not belong together: recompile "
                                f"the artifact (`llmc compile MODEL -o {path}`)")
