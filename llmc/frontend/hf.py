"""Local Hugging Face model directories: validate, load, and capture the cache-free forward.

Only local paths are read (config.json, *.safetensors, tokenizer files); nothing is downloaded.
A GPTQ or AWQ checkpoint (config.json with a `quantization_config`) is captured with its weights
dequantized, then its linears become `qlinear` nodes over the checkpoint's own codes and scales
(llmc/frontend/prequantized.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from llmc.errors import CompileError
from llmc.frontend.attention import register_hf_attention
from llmc.frontend.moe import MOE_ARCHS, check_moe_config, replace_moe_blocks
from llmc.frontend.prequantized import PrequantizedCheckpoint, read_prequantized, to_qlinear
from llmc.frontend.repeat import NotRepeatable, first_layers, repeat_layers, uniform_layers
from llmc.frontend.torch_export import capture
from llmc.ir.graph import Graph

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", *MOE_ARCHS)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
MAX_BATCH = 1024
log = logging.getLogger(__name__)


def read_config(path: Path) -> dict:
    """The config of a model directory, or a CompileError saying what is wrong with the path."""
    if not path.exists():
        raise CompileError(f"{path} does not exist. Pass a local Hugging Face model directory or builtin:NAME.")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise CompileError(f"{path} is not a model: it has no config.json. Pass a local Hugging Face model "
                           "directory (config.json + *.safetensors + tokenizer files) or builtin:NAME.")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CompileError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED for a in archs):
        raise CompileError(f"architecture {', '.join(archs) or '(none given)'} is not supported; llmc compiles "
                           f"{', '.join(SUPPORTED)}")
    if not list(path.glob("*.safetensors")):
        raise CompileError(f"{path} has no *.safetensors weights (llmc loads safetensors only, never pickle)")
    return cfg


class _Forward(torch.nn.Module):
    """The cache-free forward that llmc captures: (input_ids, position_ids) -> logits."""

    def __init__(self, m: torch.nn.Module):
        super().__init__()
        self.m = m

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               checkpoint: PrequantizedCheckpoint | None = None):
    """Load a supported local HF causal LM in eval mode with llmc's attention implementation.

    A pre-quantized model is built from its config without the `quantization_config` (transformers'
    own GPTQ/AWQ loaders need optimum, gptqmodel or autoawq and their kernels) and takes the dense
    dequantized weights of `checkpoint` (read from `path` when not given)."""
    import transformers
    path = Path(path)
    cfg = read_config(path)
    attn = register_hf_attention()
    try:
        with _quiet_transformers():
            if "quantization_config" not in cfg:
                model, info = transformers.AutoModelForCausalLM.from_pretrained(
                    path, dtype=dtype, attn_implementation=attn, local_files_only=True, output_loading_info=True)
                _check_loaded(path, model, info)
            else:
                checkpoint = checkpoint or read_prequantized(path, cfg["quantization_config"])
                config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
                del config.quantization_config
                model, info = getattr(transformers, cfg["architectures"][0]).from_pretrained(
                    None, config=config, state_dict=checkpoint.dense_state_dict(dtype), dtype=dtype,
                    attn_implementation=attn, output_loading_info=True)
                _check_loaded(path, model, info)
    except CompileError:
        raise
    except Exception as e:
        raise CompileError(f"could not load the model in {path}: {str(e).splitlines()[0][:400]}") from e
    return model.eval()


def _check_loaded(path: Path, model, info: dict) -> None:
    """CompileError where the checkpoint lacks a weight of the model (transformers would leave it at its random
    initialization) or holds a tensor of the wrong shape; a weight tied to another (the LM head to the embedding
    table) is not missing."""
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(info.get("missing_keys") or ())
    loaded = {p.data_ptr() for name, p in params.items() if name not in missing}
    absent = sorted(k for k in missing if k not in params or params[k].data_ptr() not in loaded)
    if absent:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        raise CompileError(f"{path}: the checkpoint has no {absent[0]}{more}; it is incomplete or not this "
                           "model's config")
    bad = info.get("mismatched_keys") or []
    if bad:
        raise CompileError(f"{path}: the checkpoint's {bad[0][0] if isinstance(bad[0], tuple) else bad[0]} has "
                           "another shape than the config gives it")


def _capture_layers_once(model, example, dyn, name: str, status=lambda msg: None) -> Graph | None:
    """The graph of `model` exported with its first two decoder layers and grown to all of them, or
    None where its layers are not all alike (the caller exports the whole model)."""
    found = uniform_layers(model)
    if found is None:
        return None
    prefix, layers = found
    with first_layers(model, layers):
        g = capture(_Forward(model), example, ["input_ids", "position_ids"], dyn, name=name)
    status(f"growing the graph to {len(layers)} layers")
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    try:
        repeat_layers(g, prefix, len(layers), tensors)
    except NotRepeatable as e:
        log.info("exporting every layer: %s", e)
        return None
    return g


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' progress bars and warnings off while llmc loads a model (llmc shows its own
    progress; stderr stays one line per error), restored afterwards: the caller's settings are theirs."""
    from transformers.utils import logging as hf_logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def capture_hf(path: str | Path, dtype: torch.dtype = torch.float32, repeat: bool = True,
               status=None) -> Graph:
    """Capture a local HF model as an llmc Graph `(input_ids[B,S], position_ids[B,S]) -> logits[B,S,V]`.

    With `repeat`, a model whose decoder layers are all alike is exported with two of them and the
    others are copied in llmc's IR (`llmc.frontend.repeat`); anything else is exported whole. `status`,
    if given, is called with a line as each part starts (the compile's progress and step times)."""
    status = status or (lambda msg: None)
    path = Path(path)
    cfg = read_config(path)
    check_moe_config(cfg)
    checkpoint = read_prequantized(path, cfg["quantization_config"]) if "quantization_config" in cfg else None
    status("loading the model with transformers")
    model = load_model(path, dtype, checkpoint)
    replace_moe_blocks(model, cfg["architectures"][0])  # each sparse MoE block as one `moe` op
    max_len = int(cfg.get("max_position_embeddings") or 4096)
    # example sizes avoid 0/1 so that export does not specialise them
    ids = torch.randint(0, int(cfg["vocab_size"]), (2, min(7, max_len)))
    pos = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    dyn = {"input_ids": {0: ("B", 1, MAX_BATCH), 1: ("S", 1, max_len)},
           "position_ids": {0: ("B", 1, MAX_BATCH), 1: ("S", 1, max_len)}}
    name = cfg["architectures"][0].replace("ForCausalLM", "").lower()
    status("capturing with torch.export")
    g = _capture_layers_once(model, (ids, pos), dyn, name, status) if repeat else None
    if g is None:
        g = capture(_Forward(model), (ids, pos), ["input_ids", "position_ids"], dyn, name=name)
    if checkpoint is not None:
        to_qlinear(g, checkpoint.linears)
    g.meta.update({
        "architecture": cfg["architectures"][0],
        "vocab_size": int(cfg["vocab_size"]),
        "max_position_embeddings": max_len,
        "num_hidden_layers": int(cfg["num_hidden_layers"]),
        "num_attention_heads": int(cfg["num_attention_heads"]),
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
        "eos_token_id": cfg.get("eos_token_id"),
        "bos_token_id": cfg.get("bos_token_id"),
    })
    return g
