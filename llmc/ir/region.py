"""Regions: the sub-graph of a `fused` node, held in its attributes as plain data.

    body    = [[name, op, [operand names], attrs], ...]   operands name region inputs ("in0", ...)
              or earlier body values
    outputs = [names of the body values the node returns]

Plain data keeps the text format and JSON unchanged, and codegen renders kernels from the same
list (`llmc/codegen/elementwise.py`).
"""
from __future__ import annotations

from llmc.errors import IRError
from llmc.ir.ops import RefEnv, get_op
from llmc.ir.types import TensorType


class _V:
    def __init__(self, t):
        self.type = t


class _N:
    def __init__(self, op, inputs, attrs):
        self.op, self.inputs, self.attrs = op, inputs, attrs


def region_types(attrs: dict, in_types: list[TensorType]) -> list[TensorType]:
    env = {f"in{i}": t for i, t in enumerate(in_types)}
    for name, op, args, a in attrs["body"]:
        opdef = get_op(op)
        try:
            env[name] = opdef.infer(_N(op, [_V(env[x]) for x in args], opdef.complete_attrs(dict(a))))[0]
        except KeyError as e:
            raise IRError(f"fused region: {name} uses undefined {e.args[0]}") from None
    return [env[o] for o in attrs["outputs"]]


def run_region(attrs: dict, inputs: list, env: RefEnv):
    vals = {f"in{i}": t for i, t in enumerate(inputs)}
    for name, op, args, a in attrs["body"]:
        opdef = get_op(op)
        vals[name] = opdef.ref([vals[x] for x in args], opdef.complete_attrs(dict(a)), env)
    outs = [vals[o] for o in attrs["outputs"]]
    return outs[0] if len(outs) == 1 else tuple(outs)
