"""The Triton kernels' source holds no chained boolean operator (`A and B and C`, `A or B or C`).

Triton before 3.4 refuses such a chain when it compiles a kernel ("chained boolean operators ... are
not supported; use parentheses to split the chain"), and pyproject allows Triton 3.3 where a
machine has it; the interpreter (TRITON_INTERPRET=1, the CPU tests) runs the kernel as Python and
accepts it, so no test that runs the kernel on a CPU can show it. This scan reads the source
instead: every function of ft_framework that triton.jit compiles, decorated or wrapped by a
`triton.jit(fn)` call."""

import ast
from pathlib import Path

import ft_framework

PACKAGE = Path(ft_framework.__file__).parent


def _is_triton_jit(node: ast.expr) -> bool:
    """`triton.jit`, `jit` (from triton import jit), or a call of either (`triton.jit(...)`)."""
    if isinstance(node, ast.Call):
        node = node.func
    return (isinstance(node, ast.Attribute) and node.attr == "jit" and isinstance(node.value, ast.Name)
            and node.value.id == "triton") or (isinstance(node, ast.Name) and node.id == "jit")


def triton_kernels(tree: ast.Module) -> list[ast.FunctionDef]:
    """Functions decorated with triton.jit, or passed by name to a triton.jit(...) call."""
    wrapped = {call.args[0].id for call in ast.walk(tree)
               if isinstance(call, ast.Call) and _is_triton_jit(call.func) and call.args
               and isinstance(call.args[0], ast.Name)}
    return [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
            and (f.name in wrapped or any(_is_triton_jit(d) for d in f.decorator_list))]


def chained_boolean_operators(source: str) -> list[str]:
    """'name:line' of every `and`/`or` over more than two operands inside a Triton kernel."""
    tree = ast.parse(source)
    return [f"{kernel.name}:{node.lineno}" for kernel in triton_kernels(tree) for node in ast.walk(kernel)
            if isinstance(node, ast.BoolOp) and len(node.values) > 2]


def test_the_scan_finds_kernels_and_chains():
    """The scan's own teeth: a chain in a decorated kernel and in a wrapped one is found; pairs,
    a chain outside any kernel and `&` of tensors are not."""
    source = '''
import triton
@triton.jit
def decorated(A, B, C):
    if A and B and C:
        pass
    if (A and B) and C:
        pass
def wrapped(X, Y, Z):
    x = (X > 0) & (Y > 0) & (Z > 0)
    if X or Y or Z:
        pass
def plain(a, b, c):
    return a and b and c
kernel = triton.jit(wrapped, do_not_specialize=["X"])
'''
    assert [k.name for k in triton_kernels(ast.parse(source))] == ["decorated", "wrapped"]
    assert chained_boolean_operators(source) == ["decorated:5", "wrapped:11"]


def test_no_triton_kernel_chains_boolean_operators():
    kernels, found = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if "triton" not in source:
            continue
        kernels += [f"{path.name}:{k.name}" for k in triton_kernels(ast.parse(source))]
        found += [f"{path.relative_to(PACKAGE)}:{where}" for where in chained_boolean_operators(source)]
    assert "triton_step.py:_step_kernel" in kernels  # the scan reaches the kernel it guards
    assert not found, f"chained boolean operators in Triton kernels (Triton < 3.4 cannot compile them; " \
                      f"use parentheses, e.g. (A and B) and C): {found}"
