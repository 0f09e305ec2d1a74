"""The IR text format: one line per node, printed and parsed back exactly.

    graph llama(%input_ids: i64[B,S], %position_ids: i64[B,S]) {
      dims B[1..64], S[1..2048]
      param %model.norm.weight: f32[64]
      %3: f32[B,S,64] = rms_norm(%2, %model.norm.weight) {eps=1e-06, weight_first_cast=true}
      return %logits
    }

It is the dump format and the golden-test format: print(parse(print(g))) == print(g).
"""
from __future__ import annotations

import json
import re

from llmc.errors import IRError
from llmc.ir.graph import Graph
from llmc.ir.types import TensorType

_NAME = r"[A-Za-z0-9_.\-]+"


def format_attrs(attrs: dict) -> str:
    if not attrs:
        return ""
    return " {" + ", ".join(f"{k}={json.dumps(_jsonable(v))}" for k, v in attrs.items()) + "}"


def _jsonable(v):
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def print_graph(g: Graph) -> str:
    sig = ", ".join(f"%{v.name}: {v.type}" for v in g.inputs)
    lines = [f"graph {g.name}({sig}) {{"]
    if g.dims:
        lines.append("  dims " + ", ".join(
            f"{d.name}[{d.min}..{'' if d.max is None else d.max}]" for d in g.dims.values()))
    for p in g.params:
        lines.append(f"  param %{p.name}: {p.type}")
    for n in g.nodes:
        outs = ", ".join(f"%{v.name}: {v.type}" for v in n.outputs)
        args = ", ".join("%" + v.name for v in n.inputs)
        lines.append(f"  {outs} = {n.op}({args}){format_attrs(n.attrs)}")
    lines.append("  return " + ", ".join("%" + v.name for v in g.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"


def parse_type(text: str) -> TensorType:
    m = re.fullmatch(r"\s*(\w+)\[([^\]]*)\](?:<([^>]*)>)?\s*", text)
    if not m:
        raise IRError(f"cannot parse type {text!r}; expected like bf16[T,4096]")
    dims = [d.strip() for d in m.group(2).split(",") if d.strip()]
    return TensorType(tuple(int(d) if re.fullmatch(r"-?\d+", d) else d for d in dims), m.group(1), m.group(3))


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[(<{":
            depth += 1
        elif ch in "])>}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts]


def parse_attrs(text: str) -> dict:
    """Parse `{k=<json>, k2=<json>}` with a JSON decoder for each value, so strings may hold anything."""
    text = text.strip()
    if not text:
        return {}
    if not (text.startswith("{") and text.endswith("}")):
        raise IRError(f"attributes must be in braces: {text!r}")
    dec, out, i, body = json.JSONDecoder(), {}, 0, text[1:-1]
    while i < len(body):
        m = re.compile(r"\s*(\w+)=").match(body, i)
        if not m:
            raise IRError(f"cannot parse attributes at {body[i:]!r}")
        val, i = dec.raw_decode(body, m.end())
        out[m.group(1)] = val
        m2 = re.compile(r"\s*(,|$)").match(body, i)
        if not m2:
            raise IRError(f"expected ',' in attributes at {body[i:]!r}")
        i = m2.end()
    return out


_NODE = re.compile(rf"^(?P<outs>.+?) = (?P<op>\w+)\((?P<args>[^)]*)\)(?P<attrs>\s*\{{.*\}})?$")


def parse_graph(text: str) -> Graph:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip() and not ln.strip().startswith("#")]
    m = re.fullmatch(rf"graph ({_NAME})\((.*)\) \{{", lines[0]) if lines else None
    if not m or lines[-1] != "}":
        raise IRError("IR text must start with 'graph NAME(...) {' and end with '}'")
    g = Graph(m.group(1))
    for part in _split_top(m.group(2)):
        name, ty = part.split(":", 1)
        g.add_input(name.strip().lstrip("%"), parse_type(ty))
    vals = {v.name: v for v in g.inputs}

    def ref(tok: str):
        tok = tok.strip()
        if not tok.startswith("%") or tok[1:] not in vals:
            raise IRError(f"undefined value {tok!r}")
        return vals[tok[1:]]

    for lineno, ln in enumerate(lines[1:-1], 2):
        try:
            if ln.startswith("dims "):
                for part in _split_top(ln[5:]):
                    dm = re.fullmatch(r"(\w+)\[(\d+)\.\.(\d*)\]", part)
                    if not dm:
                        raise IRError(f"bad dim declaration {part!r}")
                    g.add_dim(dm.group(1), int(dm.group(2)), int(dm.group(3)) if dm.group(3) else None)
            elif ln.startswith("param "):
                name, ty = ln[6:].split(":", 1)
                v = g.add_param(name.strip().lstrip("%"), type=parse_type(ty))
                vals[v.name] = v
            elif ln.startswith("return"):
                g.outputs = [ref(t) for t in _split_top(ln[6:])]
            else:
                nm = _NODE.match(ln)
                if not nm:
                    raise IRError("expected '%out: type = op(args) {attrs}'")
                outs = [o.split(":", 1) for o in _split_top(nm.group("outs"))]
                args = [ref(a) for a in _split_top(nm.group("args"))]
                node = g.add_node(nm.group("op"), args, parse_attrs(nm.group("attrs") or ""),
                                  names=[o[0].strip().lstrip("%") for o in outs],
                                  types=[parse_type(o[1]) for o in outs])
                vals.update({v.name: v for v in node.outputs})
        except IRError as e:
            raise IRError(f"line {lineno}: {e}: {ln}") from None
    return g
