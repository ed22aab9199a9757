"""The kernel's coefficient names are one list: the C++ struct, its binding and the Python side agree.

The test parses cpp/step_args.h (struct StepCoeffs) and cpp/bindings.cpp (the def_readwrite lines of
Coefficients) and compares both, names and order, with coefficients.KERNEL_FIELDS; every field of
StepCoefficients must reach the kernel under its own name.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from ft_framework.optim import cpu
from ft_framework.optim.coefficients import KERNEL_FIELDS, StepCoefficients, kernel_values

CPP = Path(__file__).resolve().parents[3] / "cpp"


def _struct_fields(header: str, struct: str) -> list[str]:
    body = re.search(r"struct\s+" + struct + r"\s*\{(.*?)\};", header, re.S)
    assert body, f"struct {struct} not found"
    names: list[str] = []
    for decl in re.sub(r"//[^\n]*", "", body.group(1)).split(";"):
        decl = decl.strip()
        if not decl:
            continue
        match = re.fullmatch(r"float\s+(.*)", decl, re.S)
        assert match, f"unexpected member declaration in {struct}: {decl!r}"
        names += [n.strip() for n in match.group(1).split(",")]
    return names


def _bound_fields(bindings: str) -> list[str]:
    assert "py::class_<ftk::StepCoeffs>" in bindings, "the Coefficients binding was not found"
    pairs = re.findall(r'def_readwrite\("(\w+)",\s*&ftk::StepCoeffs::(\w+)\)', bindings)
    for python_name, member in pairs:
        assert python_name == member, f"bound as {python_name!r} but the member is {member!r}"
    return [name for name, _ in pairs]


def test_header_struct_matches_the_list():
    assert _struct_fields((CPP / "step_args.h").read_text(), "StepCoeffs") == list(KERNEL_FIELDS)


def test_binding_exposes_every_field_in_order():
    assert _bound_fields((CPP / "bindings.cpp").read_text()) == list(KERNEL_FIELDS)


def test_every_python_coefficient_reaches_the_kernel():
    own = [f.name for f in dataclasses.fields(StepCoefficients)]
    assert set(own) <= set(KERNEL_FIELDS)
    c = StepCoefficients(beta1=0.9, beta2=0.999, eps=1e-8, step_size=0.01, denom_scale=2.0,
                         pre_decay=0.1, pre_pull=0.2, post_pull=0.3, post_decay=0.4)
    values = kernel_values(c)
    assert list(values) == list(KERNEL_FIELDS)
    for name in own:
        assert values[name] == getattr(c, name)
    assert values["one_minus_beta1"] == pytest.approx(0.1, abs=0, rel=1e-15)
    assert values["one_minus_beta2"] == pytest.approx(0.001, abs=0, rel=1e-12)


def test_parser_notices_a_drift():
    header = (CPP / "step_args.h").read_text().replace("float post_pull;", "float post_pul;")
    assert _struct_fields(header, "StepCoeffs") != list(KERNEL_FIELDS)


@pytest.mark.skipif(not cpu.kernel_available(), reason="the C++ kernel is not built")
def test_built_kernel_holds_the_values():
    c = StepCoefficients(beta1=0.5, beta2=0.75, eps=0.125, step_size=0.25, denom_scale=2.0,
                         pre_decay=0.0625, pre_pull=0.5, post_pull=0.25, post_decay=0.125)
    k = cpu._kernel_coefficients(c)
    for name, value in kernel_values(c).items():
        assert getattr(k, name) == value, name  # all exact in fp32


# The entry points that run the element program and the name of their per-element importance
# argument (cpp/step_args.h): every one of them takes it, optional, so a caller without it runs the
# unweighted program.
IMPORTANCE_ARGUMENTS = {
    "fused_step": "importance", "guarded_step": "importance", "fused_inverse": "importance",
    "fused_step_compact": "importance", "_fused_step_many": "importances", "_fused_step_compact_many": "importances",
}


def _def_blocks(bindings: str) -> dict[str, str]:
    """Each m.def("name", ...) of the module, up to the next m.def or the module's end."""
    starts = [(m.group(1), m.start()) for m in re.finditer(r'm\.def\("(\w+)"', bindings)]
    ends = [start for _, start in starts[1:]] + [len(bindings)]
    return {name: bindings[start:end] for (name, start), end in zip(starts, ends)}


def test_every_step_entry_point_takes_an_optional_importance():
    blocks = _def_blocks((CPP / "bindings.cpp").read_text())
    for name, argument in IMPORTANCE_ARGUMENTS.items():
        assert name in blocks, f"m.def({name!r}) not found"
        assert re.search(r'py::arg\("' + argument + r'"\)\s*=', blocks[name]), \
            f"{name} does not take an optional {argument!r}"


@pytest.mark.skipif(not cpu.kernel_available(), reason="the C++ kernel is not built")
def test_the_built_kernel_takes_the_importance():
    for name, argument in IMPORTANCE_ARGUMENTS.items():
        assert f"{argument}:" in getattr(cpu._kernel, name).__doc__, name
