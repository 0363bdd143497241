"""The package's shape, read from its sources: no import cycle, the core free of the benchmarks and the lab
runner, rooms and functions within their sizes, the engine's instance small and its step short, no method
shadowed by an instance attribute, no private engine member reached from the benchmarks or notebooks. Each
checker is shown failing on a planted case."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kdtree"
CORE = ("kdtree.config", "kdtree.model", "kdtree.engine", "kdtree.ops", "kdtree.budget")
OUTSIDE_CORE = ("kdtree.bench", "kdtree.lab", "kdtree.lab_params", "kdtree.lab_kinds", "kdtree.report")
MODULE_MAX, ENGINE_MODULE_MAX, MODEL_MAX, FUNCTION_MAX = 450, 400, 800, 80
LONG_FUNCTIONS_ALLOWED = {("kdtree.model", "forward")}   # the model's forward


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(pkg: Path = PKG) -> dict[str, Path]:
    return {module_name(p, pkg.parent): p for p in sorted(pkg.rglob("*.py"))}


def imports(path: Path, name: str, known) -> set[str]:
    """The package's modules that `path` (module `name`) imports anywhere in it, lazy imports included."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            base = pkg.split(".")[:len(pkg.split(".")) - (n.level - 1)] if n.level else []
            mod = ".".join(base + ([n.module] if n.module else []))
            for a in n.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in known else mod)
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
    return {m for m in out if m in known and m != name}


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    mods = modules(pkg)
    return {m: imports(p, m, mods) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "plant"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("import plant.a\n")
    (pkg / "d.py").write_text("from . import a\n")
    assert cycles(import_graph(pkg)) == [["plant.a", "plant.c", "plant.sub.b"]]


def core_reaching_outside(graph) -> list[tuple[str, str]]:
    def inside(m, prefixes):
        return any(m == p or m.startswith(p + ".") for p in prefixes)
    return sorted((m, d) for m, deps in graph.items() if inside(m, CORE)
                  for d in deps if inside(d, OUTSIDE_CORE))


def test_the_core_never_imports_the_benchmarks_or_the_lab():
    graph = import_graph()
    assert core_reaching_outside(graph) == []
    planted = {**graph, "kdtree.engine.runner": graph["kdtree.engine.runner"] | {"kdtree.bench.serve"}}
    assert core_reaching_outside(planted) == [("kdtree.engine.runner", "kdtree.bench.serve")]


def oversized(mods: dict[str, Path]) -> list[str]:
    """Modules past their line limit and functions past FUNCTION_MAX lines (def to last line)."""
    bad = []
    for m, p in mods.items():
        src = p.read_text()
        n = src.count("\n")
        limit = (MODEL_MAX if m == "kdtree.model" else ENGINE_MODULE_MAX
                 if m.startswith(("kdtree.engine", "kdtree.budget")) else MODULE_MAX)
        if n > limit:
            bad.append(f"{m}: {n} lines (at most {limit})")
        for f in ast.walk(ast.parse(src)):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if (m, f.name) not in LONG_FUNCTIONS_ALLOWED:
                length = f.end_lineno - f.lineno + 1
                if length > FUNCTION_MAX:
                    bad.append(f"{m}.{f.name}: {length} lines (at most {FUNCTION_MAX})")
    return bad


def test_rooms_and_functions_stay_within_their_sizes(tmp_path):
    assert oversized(modules()) == []
    (tmp_path / "big.py").write_text("def f():\n" + "    x = 1\n" * FUNCTION_MAX + "\n" * MODULE_MAX)
    assert [b.split(":")[0] for b in oversized({"big": tmp_path / "big.py"})] == ["big", "big.f"]


def shadowed(source: str) -> list[str]:
    """Class.name where a method `name` (not a property) is assigned over as `self.name = ...`."""
    bad = []
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef):
            continue
        methods = {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and not any(ast.unparse(d) == "property" or ast.unparse(d).endswith(".setter")
                               for d in f.decorator_list)}
        for n in ast.walk(cls):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                n, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for e in ast.walk(t):
                    if (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
                            and e.value.id == "self" and e.attr in methods):
                        bad.append(f"{cls.name}.{e.attr}")
    return sorted(set(bad))


def test_no_method_is_shadowed_by_an_instance_attribute():
    bad = [f"{m}: {s}" for m, p in modules().items() for s in shadowed(p.read_text())]
    assert bad == []
    planted = ("class P:\n    def start(self):\n        pass\n\n    def buffers(self):\n"
               "        self.tok, self.start = 1, 2\n\n    @property\n    def x(self):\n        pass\n\n"
               "    @x.setter\n    def x(self, v):\n        self.x = v\n")
    assert shadowed(planted) == ["P.start"]


PRIVATE_ENGINE = re.compile(r"\b(?:e|eng|engine|self\.e|self\.engine)\._[a-z]\w*")


def private_engine_uses(texts: dict[str, str]) -> list[str]:
    return [f"{where}: {m.group(0)}" for where, text in texts.items() for m in PRIVATE_ENGINE.finditer(text)]


def test_benchmarks_and_notebooks_use_the_engine_s_public_api_only():
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in (PKG / "bench").rglob("*.py")}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        texts[str(nb.relative_to(ROOT))] = "\n".join("".join(c["source"]) for c in cells
                                                      if c["cell_type"] == "code")
    assert private_engine_uses(texts) == []
    assert private_engine_uses({"planted.py": "x = engine._flight\n"}) == ["planted.py: engine._flight"]


def test_tests_reach_few_private_engine_members():
    texts = {p.name: p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_layout.py"}
    assert len(private_engine_uses(texts)) <= 10


def step_body_lines(source: str) -> int:
    """Engine.step's lines past its docstring."""
    cls = next(c for c in ast.parse(source).body if isinstance(c, ast.ClassDef) and c.name == "Engine")
    step = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "step")
    first = step.body[1] if isinstance(step.body[0], ast.Expr) else step.body[0]
    return step.end_lineno - first.lineno + 1


def test_the_engine_holds_few_attributes_and_steps_in_fifteen_lines():
    import torch

    from kdtree.config import TINY_A
    from kdtree.engine import Engine
    from kdtree.model import Transformer

    torch.manual_seed(0)
    e = Engine(Transformer(TINY_A).eval(), None, mode="ar", max_batch=2)
    assert len(vars(e)) <= 30, sorted(vars(e))
    assert step_body_lines((PKG / "engine" / "engine.py").read_text()) <= 15
    long_step = "class Engine:\n    def step(self):\n        '''doc'''\n" + "        x = 1\n" * 16
    assert step_body_lines(long_step) == 16


def test_benchmark_modules_run_as_commands_without_a_second_import():
    """The benchmark package hands its names on lazily, so `python -m kdtree.bench.<module>` runs a module the
    package's import has not loaded (runpy warns, and the module would exist twice, where it had)."""
    import subprocess
    import sys

    import kdtree.bench as bench
    assert sorted(bench.__all__) == sorted(bench._HOMES)
    for mod in ("moe", "verify"):
        cmd = [sys.executable, "-W", "error::RuntimeWarning", "-m", f"kdtree.bench.{mod}", "--help"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 0 and "RuntimeWarning" not in r.stderr, (mod, r.stderr[-500:])
