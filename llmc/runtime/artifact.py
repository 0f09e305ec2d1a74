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

import datetime
import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmc.errors import ArtifactError, IRError
from llmc.ir.graph import Graph, WeightStore
from llmc.ir.serialize import graph_from_dict, graph_to_dict

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class Artifact:
    """A loaded (or just written) artifact: its path, manifest and graph with weights attached."""

    path: Path
    manifest: dict[str, Any]
    graph: Graph
    tuning: dict[str, Any] = field(default_factory=dict)
    compile_log: Any = None

    @property
    def tokenizer_dir(self) -> Path | None:
        """The copied tokenizer files, or None when the source model had no tokenizer."""
        d = self.path / "tokenizer"
        found = any((d / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
        return d if found else None

    def tokenizer(self):
        """The artifact's tokenizer (transformers' AutoTokenizer over the copied files)."""
        if self.tokenizer_dir is None:
            raise ArtifactError(f"artifact {self.path} has no tokenizer; compile from a model directory "
                                "that holds tokenizer files, or pass token ids")
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(self.tokenizer_dir), local_files_only=True)

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
        }


def save_artifact(graph: Graph, out: str | Path, source: str, options: dict[str, Any],
                  tokenizer_files: list[Path] | None = None, tuning: dict | None = None,
                  kernels: dict[str, str] | None = None, kernel_list: list[dict] | None = None) -> Artifact:
    """Write `graph` and its weights as an artifact directory (replacing an existing artifact there)."""
    from safetensors.torch import save_file
    from llmc import __version__
    out = Path(out)
    if out.exists():
        if not (out / MANIFEST).exists() and any(out.iterdir()):
            raise ArtifactError(f"{out} exists and is not an llmc artifact; choose another output path")
        shutil.rmtree(out)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "graph.json").write_text(json.dumps(graph_to_dict(graph), indent=1))
    tensors = {p.name: graph.weights[p.name].contiguous() for p in graph.params}
    save_file(tensors, str(tmp / "weights.safetensors"))
    (tmp / "tuning.json").write_text(json.dumps(tuning or {}, indent=1))
    (tmp / "tokenizer").mkdir()
    for f in tokenizer_files or []:
        shutil.copy2(f, tmp / "tokenizer" / f.name)
    (tmp / "kernels").mkdir()
    for name, src in (kernels or {}).items():
        (tmp / "kernels" / name).write_text(src)
    files = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {
        "format_version": FORMAT_VERSION,
        "llmc_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "options": options,
        "passes": graph.meta.get("passes", []),
        "model": {k: v for k, v in graph.meta.items() if k != "passes"},
        "kernels": kernel_list or [],
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    tmp.rename(out)  # the artifact appears whole or not at all
    return Artifact(out, manifest, graph, tuning or {})


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir() or not (path / MANIFEST).is_file():
        raise ArtifactError(f"{path} is not an llmc artifact (no {MANIFEST}); create one with `llmc compile`")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path / MANIFEST} is not valid JSON: {e}") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"artifact {path} has format version {version!r}; this llmc reads version "
                            f"{FORMAT_VERSION}. Recompile the model with this llmc.")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any]) -> None:
    """Check every file against its recorded sha256; raise naming the first that differs."""
    for rel, digest in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            raise ArtifactError(f"artifact {path} is missing {rel}; recompile it")
        if sha256_file(f) != digest:
            raise ArtifactError(f"artifact file {rel} is corrupted (sha256 mismatch with the manifest); "
                                "recompile the artifact or restore the file")


def load_artifact(path: str | Path, verify: bool = True) -> Artifact:
    """Load an artifact: check its format version and file hashes, read the graph and weights."""
    from safetensors.torch import load_file
    path = Path(path)
    manifest = read_manifest(path)
    if verify:
        verify_files(path, manifest)
    try:
        graph = graph_from_dict(json.loads((path / "graph.json").read_text()))
    except (IRError, KeyError, json.JSONDecodeError) as e:
        raise ArtifactError(f"artifact {path}: graph.json cannot be read: {e}") from None
    graph.weights = WeightStore(load_file(str(path / "weights.safetensors")))
    missing = [p.name for p in graph.params if p.name not in graph.weights]
    if missing:
        raise ArtifactError(f"artifact {path}: weights for {missing[:3]} are missing")
    tuning = json.loads((path / "tuning.json").read_text()) if (path / "tuning.json").exists() else {}
    return Artifact(path, manifest, graph, tuning)
