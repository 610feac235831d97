"""Regimes travel as objects (issue 36.2): no function of the library, its commands or its
benchmarks takes more than 10 parameters, except compiled kernels (numba ``@njit``/``@jit``/
``@cuda.jit``, whose arguments must be flat arrays and scalars). ``self``/``cls`` do not
count; ``*args`` and ``**kwargs`` count one each."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 10


def _compiled(node) -> bool:
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = ast.unparse(target)
        if name.split(".")[-1] in ("njit", "jit", "vectorize", "guvectorize") or \
                name.startswith(("numba.", "cuda.", "nb.")):
            return True
    return False


def _count(node) -> int:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args]
    n = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if names and names[0] in ("self", "cls") else 0)


def _wide_functions() -> list[str]:
    out = []
    for pkg in ("dynamics", "hermite", "sims", "benchmarks"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        not _compiled(node) and _count(node) > LIMIT:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                               f"({_count(node)})")
    return out


def test_the_counter_sees_parameters_and_kernels():
    tree = ast.parse("from numba import njit\n"
                     "@njit(cache=True)\ndef k(a, b, c, d, e, f, g, h, i, j, k, l): pass\n"
                     "def w(self, a, b, c, d, e, f, g, h, i, j, *, k=1, **kw): pass\n")
    kernel, wide = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert _compiled(kernel) and not _compiled(wide)
    assert _count(kernel) == 12 and _count(wide) == 12


def test_no_function_takes_more_than_ten_parameters():
    wide = _wide_functions()
    assert not wide, "functions over 10 parameters (pass a regime or options object):\n" + \
        "\n".join(wide)
