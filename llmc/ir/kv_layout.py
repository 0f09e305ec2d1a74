"""The KV cache of a paged graph: which inputs hold it and their dtype (auto, int8 or fp8).

Compile time (the paged_kv pass) and load time (the runtime, which may override the dtype) both set
the layout through `set_kv_cache_dtype`, so the two can never disagree on it.
"""
from __future__ import annotations

from llmc.errors import IRError
from llmc.ir.graph import Graph, Value
from llmc.ir.ops import get_op
from llmc.ir.paged_attention import scale_width
from llmc.ir.types import TensorType

KV_DTYPES = {"auto": None, "int8": "i8", "fp8": "f8e4m3"}


def kv_cache_inputs(g: Graph) -> list[Value]:
    return [v for v in g.inputs if v.name.startswith("kv_cache.")]


def kv_model_dtype(cache: Value, users: dict) -> str:
    """The dtype of the activations a cache stores (its readers' first operand), whatever it is kept in."""
    return next((n.inputs[0].type.dtype for n in users.get(cache, [])), cache.type.dtype)


def set_kv_cache_dtype(g: Graph, kv_cache_dtype: str) -> Graph:
    """Retype the KV caches of a paged graph (auto / int8 / fp8), adding or dropping the scale inputs.

    Every op that reads or writes a cache (paged_attention, rope_kv_write, attend_paged) takes the
    scale as its optional last operand `kv_scale`.
    """
    if kv_cache_dtype not in KV_DTYPES:
        raise IRError(f"kv cache dtype must be one of {', '.join(KV_DTYPES)}, not {kv_cache_dtype!r}")
    users = g.users()
    for cache in kv_cache_inputs(g):
        nodes = users.get(cache, [])
        model_dtype = kv_model_dtype(cache, users)
        want = KV_DTYPES[kv_cache_dtype] or model_dtype
        cache.type = cache.type.with_dtype(want)
        quant = want in ("i8", "f8e4m3")
        scale_name = f"kv_scale.{cache.name.split('.', 1)[1]}"
        scale = next((v for v in g.inputs if v.name == scale_name), None)
        if quant:  # the current layout, also over a scale input an older artifact declared
            s = cache.type.shape
            scale_type = TensorType((s[1], s[3], scale_width(s[4], s[2])), model_dtype)
            if scale is None:
                scale = g.add_input(scale_name, scale_type)
            scale.type = scale_type
        for n in nodes:
            at = get_op(n.op).operands.index("kv_scale?")
            n.inputs = n.inputs[:at] + ([scale] if quant else [])
        if not quant and scale is not None:
            g.inputs.remove(scale)
            g._names.discard(scale_name)
    g.meta["kv_cache_dtype"] = kv_cache_dtype
    return g
