"""Layering: the theory (``hermite``) stands alone, without torch and without the engine;
the import graph of hermite/, dynamics/ and sims/ has no cycle and respects the layers."""

import ast
import re
import subprocess
import sys
from pathlib import Path


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_hermite_imports_without_torch_or_engine():
    out = _fresh("import sys, hermite, hermite.activations, hermite.activations_numba\n"
                 "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                 "('torch', 'dynamics', 'sims')))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_torch_side_matches_numpy_side():
    import numpy as np
    import torch

    from dynamics.activations import torch_activation
    from hermite.activations import activation_from_callable, get_activation

    x = np.linspace(-3.0, 3.0, 61)
    xt = torch.as_tensor(x)
    custom = activation_from_callable(np.sin, np.cos, name="sin")
    for act in [get_activation(n) for n in
                ("relu", "abs", "sigmoid", "tanh", "erf", "quadratic", "linear", "he3")] + [custom]:
        ta = torch_activation(act)
        assert ta.theory is act and ta.name == act.name
        for f_t, f_np in ((ta.fn, act.fn), (ta.deriv, act.deriv)):
            out = f_t(xt)
            assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
            np.testing.assert_allclose(out.numpy(), f_np(x), rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------- module import graph
_ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = ("hermite", "dynamics", "sims")


def _modules() -> dict:
    """Dotted module name → source path, for every module of the three packages."""
    out = {}
    for pkg in _PACKAGES:
        for path in sorted((_ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(_ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _import_graph() -> dict:
    """Module → the project modules it imports, from every ``import``/``from`` statement of
    its source (top level and inside functions; relative ones resolved). Importing ``a.b.c``
    also runs the packages ``a`` and ``a.b``, so those count too, except the importer's own
    enclosing packages (already being imported when it runs)."""
    mods = _modules()

    def known(name):  # the longest prefix of ``name`` that is a project module
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                for a in node.names:  # ``from pkg import submodule`` imports the submodule
                    sub = f"{source}.{a.name}"
                    targets.add(sub if sub in mods else known(source))
        own = {mod.rsplit(".", i)[0] for i in range(mod.count(".") + 1)}
        for t in [t for t in targets if t]:
            parts = t.split(".")
            targets.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                           if p in mods and p not in own)
        graph[mod] = sorted(t for t in targets if t and t != mod)
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_import_graph_has_no_cycle():
    graph = _import_graph()
    # the walk found the source
    assert "dynamics.runtime.trajectory" in graph and "sims.cli" in graph
    cycles = _cycles(graph)
    detail = "\n".join(
        " ↔ ".join(c) + "\n" + "\n".join(f"    {m} → {[t for t in graph[m] if t in c]}"
                                         for m in c)
        for c in cycles)
    assert not cycles, f"import cycles between modules:\n{detail}"


def test_import_graph_layers():
    """hermite imports nothing from dynamics or sims; dynamics nothing from sims."""
    forbidden = {"hermite": ("dynamics", "sims"), "dynamics": ("sims",), "sims": ()}
    bad = [f"{mod} → {t}" for mod, targets in _import_graph().items() for t in targets
           if t.split(".")[0] in forbidden[mod.split(".")[0]]]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_loradyn_help_imports_no_subcommand():
    """``loradyn --help`` lists the commands from ``sims.cli.COMMANDS`` without importing
    any of them (nor torch, numba or the engine)."""
    out = _fresh("import sys\nfrom click.testing import CliRunner\nfrom sims.cli import cli\n"
                 "res = CliRunner().invoke(cli, ['--help'])\nassert res.exit_code == 0\n"
                 "print(res.output)\n"
                 "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                 "('torch', 'numba', 'dynamics', 'hermite') or m.startswith('sims.commands')))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    for name in ("bench", "hermite", "plot", "reproduce", "run", "scaling", "show", "sweep"):
        assert f"  {name} " in out.stdout


def test_listed_help_is_each_commands_own():
    from click.testing import CliRunner

    from sims.cli import COMMANDS, cli

    for name, (_, _, listed) in COMMANDS.items():
        command = cli.get_command(None, name)
        assert command.name == name
        assert listed == command.get_short_help_str(limit=10_000), name
        assert CliRunner().invoke(cli, [name, "--help"]).exit_code == 0
    assert cli.get_command(None, "nope") is None


# ---------------------------------------------------------------- rooms (issue 36)
#: each package's rooms from the bottom up: a module imports only from its own room, the
#: package root or a room of a lower rank (rooms of the same rank never import each other)
_ROOMS = {
    "dynamics": {"": 0, "runtime": 1, "randomness": 1, "geometry": 1, "instances": 2,
                 "measures": 3, "overlays": 4, "learners": 5, "setup": 6, "reduced": 7,
                 "engines": 8},
    "hermite": {"": 0, "expansion": 1, "committee": 1, "flows": 2, "finite_d": 3,
                "finetune": 4},
}
_ROOT_MODULES = {"dynamics": 6, "hermite": 8}


def _room(mod: str) -> tuple[str, str]:
    pkg, _, rest = mod.partition(".")
    head, _, tail = rest.partition(".")
    return pkg, head if tail or (_ROOT / pkg / head).is_dir() else ""


def test_rooms_are_known_and_root_is_small():
    """Every folder of dynamics/ and hermite/ is a room of the table above (a new folder is
    placed in the order on purpose), and each root keeps only what its package shares."""
    for pkg, rooms in _ROOMS.items():
        folders = {p.name for p in (_ROOT / pkg).iterdir()
                   if p.is_dir() and (p / "__init__.py").exists()}
        assert folders == set(rooms) - {""}, pkg
        root = sorted(p.name for p in (_ROOT / pkg).glob("*.py"))
        assert len(root) <= _ROOT_MODULES[pkg], (pkg, root)


def test_rooms_name_their_contents():
    """Each room's docstring says what lives there: every public module of the folder is
    named in it (by its file stem), and so is what it may import."""
    missing = []
    for pkg, rooms in _ROOMS.items():
        for room in set(rooms) - {""}:
            init = _ROOT / pkg / room / "__init__.py"
            doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
            assert doc, f"{pkg}/{room} has no docstring"
            for path in sorted((_ROOT / pkg / room).glob("*.py")):
                if not path.stem.startswith("_") and path.stem not in doc:
                    missing.append(f"{pkg}/{room}: {path.stem}")
    assert not missing, "modules a room's docstring does not name:\n" + "\n".join(missing)


def test_rooms_import_only_downward():
    bad = []
    for mod, targets in _import_graph().items():
        pkg, room = _room(mod)
        if pkg not in _ROOMS:
            continue
        rank = _ROOMS[pkg][room]
        for t in targets:
            tpkg, troom = _room(t)
            if tpkg != pkg or troom == room or t == pkg:
                continue
            if troom and _ROOMS[pkg][troom] >= rank or not troom and room == "" and t != pkg:
                bad.append(f"{mod} ({room or 'root'}) → {t} ({troom or 'root'})")
    assert not bad, "imports from a room to one above it or beside it:\n" + "\n".join(bad)


def test_library_tests_load_no_benchmark_script():
    """A measurement the library's tests need lives in the library: only a benchmark's own
    test (``test_<name>_benchmark.py``) may load a script of benchmarks/."""
    by_path = re.compile(r"""["']benchmarks["']\s*/|["']benchmarks/""")
    bad = [p.name for p in sorted((_ROOT / "tests").glob("test_*.py"))
           if not p.stem.endswith("_benchmark") and by_path.search(p.read_text("utf-8"))]
    assert not bad, bad


def test_public_names_resolve_from_the_packages():
    """Users call the packages' own names (``hermite.finetune_ode``, ``dynamics.simulate``):
    every name either package exports resolves to the object its room defines."""
    out = _fresh("import dynamics, hermite\n"
                 "for pkg in (dynamics, hermite):\n"
                 "    for name in pkg.__all__:\n"
                 "        obj = getattr(pkg, name)\n"
                 "        named = getattr(obj, '__name__', name)\n"
                 "        assert named == name or not callable(obj), name\n"
                 "from dynamics.engines.engine import simulate\n"
                 "from hermite.finite_d.corrected_ode import corrected_ode\n"
                 "assert dynamics.simulate is simulate and hermite.corrected_ode is corrected_ode\n"
                 "print(len(dynamics.__all__) + len(hermite.__all__))")
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 60
