"""benchmarks/pdl_off.py turns programmatic dependent launch off for the named templates' kernels only, and
refuses a template that does not exist (a typo would otherwise time PDL on everywhere and say nothing)."""
import pytest

from llmc.codegen import elementwise, kernels
from tests.scripts import BENCHMARKS, load_script


class Spec:
    def __init__(self, template):
        self.template = template

    def __hash__(self):
        return hash(self.template)


def test_only_the_named_templates_load_without_pdl(monkeypatch):
    pdl_off = load_script("pdl_off", BENCHMARKS)
    loads = []
    monkeypatch.setattr(kernels, "load", lambda spec, pdl: loads.append((spec.template, pdl)))
    monkeypatch.setattr(elementwise, "_module", elementwise._module)  # restored after the test
    pdl_off.templates_off(["rms_norm", "paged_attention_decode"])
    for t in ("rms_norm.py.jinja", "qmatmul_linear.py.jinja", "paged_attention_decode.py.jinja"):
        elementwise._module(Spec(t), False, True)
    elementwise._module(Spec("matmul.py.jinja"), False, False)  # PDL off everywhere stays off
    assert loads == [("rms_norm.py.jinja", False), ("qmatmul_linear.py.jinja", True),
                     ("paged_attention_decode.py.jinja", False), ("matmul.py.jinja", False)]
    with pytest.raises(SystemExit, match="no template named rmsnorm; the templates: .*rms_norm"):
        pdl_off.templates_off(["rmsnorm"])
