"""The package's imports run one way (docs/architecture.md): each module imports only from its
own layer or the layers below, and no two modules import each other, directly or round about;
the kernels' own package (inkling_kernels, the top-level kernels/) imports nothing of
inkling_quant. Read from the source with `ast` (nothing is imported; one test also imports the
kernels' package, in a subprocess), lazy imports inside functions included, `if TYPE_CHECKING:`
blocks excluded (they never run). Cheap: part of the test suite, so CI runs it."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "inkling_quant"
KERNELS = ROOT / "kernels" / "inkling_kernels"  # the kernels' own package: layer 4 to inkling_quant
OURS = ("inkling_quant", "inkling_kernels")

# bottom to top; a module's layer is that of the longest prefix listed; the rest are commands
LAYERS = [
    ("inkling_quant", "inkling_quant.errors", "inkling_quant.units", "inkling_quant.cli.options"),
    ("inkling_quant.io", "inkling_quant.hub"),
    ("inkling_quant.model",),
    ("inkling_quant.formats",),
    ("inkling_kernels",),  # imports nothing of inkling_quant (test_the_kernels_import_nothing_of_inkling_quant)
    ("inkling_quant.schemes",),
    ("inkling_quant.export",),
    ("inkling_quant.data", "inkling_quant.engine"),  # the model's forward from the shards (calibrate, eval)
    # plan/: on model knowledge, formats and schemes (the `plan` command: cli/plan.py, with the others)
    ("inkling_quant.plan.units", "inkling_quant.plan.placement", "inkling_quant.plan.kvcache",
     "inkling_quant.plan.moe_checks", "inkling_quant.plan.deepseek_v4", "inkling_quant.plan.kimi_k3"),
    ("inkling_quant.plan.hf", "inkling_quant.plan.inkling2"),
    ("inkling_quant.plan",),
]
COMMANDS = len(LAYERS)


def layer_of(module: str) -> int:
    best, layer = -1, COMMANDS
    for i, names in enumerate(LAYERS):
        for n in names:
            exact_only = n == "inkling_quant"  # the package root's own __init__, not everything
            if module == n or (not exact_only and module.startswith(n + ".") and len(n) > best):
                best, layer = len(n), i
    return layer


def _root(path: Path) -> Path:
    """The directory `path`'s top-level package sits in (the repository, or kernels/)."""
    return KERNELS.parent if path.is_relative_to(KERNELS) else PKG.parent


def module_name(path: Path) -> str:
    rel = path.relative_to(_root(path)).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path, type_only: bool = False) -> set[str]:
    """Every inkling_quant or inkling_kernels module `path` imports (absolute names);
    `type_only`: those under `if TYPE_CHECKING:` too."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_only:
                for n in child.orelse:
                    visit(n)
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                if mod.startswith(OURS):
                    for alias in child.names:  # `from . import kernels` imports a module
                        sub = f"{mod}.{alias.name}"
                        out.add(sub if _exists(sub) else mod)
            elif isinstance(child, ast.Import):
                out.update(a.name for a in child.names if a.name.startswith(OURS))
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    out.discard(me)
    return out


def _exists(module: str) -> bool:
    p = (KERNELS.parent if module.startswith("inkling_kernels") else PKG.parent) / Path(*module.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def sources() -> list[Path]:
    return sorted(PKG.rglob("*.py")) + sorted(KERNELS.rglob("*.py"))


def graph(type_only: bool = False) -> dict[str, set[str]]:
    return {module_name(p): imports_of(p, type_only) for p in sources()}


def test_imports_run_downward():
    upward = [f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
              for m, deps in graph().items() for d in sorted(deps)
              if layer_of(d) > layer_of(m) and not (m == "inkling_quant" and d.startswith("inkling_quant."))]
    assert not upward, "imports against the layering of docs/architecture.md:\n" + "\n".join(upward)


def test_no_import_cycles():
    """No circle, type-only imports (`if TYPE_CHECKING:`) included: a circle there is a circle of
    concerns even where Python would not trip over it."""
    g = graph(type_only=True)
    # a package's __init__ re-exporting its own modules is not a cycle between concerns
    edges = {m: {d for d in deps if d in g and not d.startswith(m + ".")} for m, deps in g.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def dfs(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                dfs(d, path + [d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            dfs(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_kernels_import_nothing_of_inkling_quant():
    """inkling_kernels is a lower-level library of its own (as sgl-kernel is to sglang): not one
    of its modules imports inkling_quant, type-only imports included, and importing it loads
    none; and kernels/ is no package itself, so that a process started in the repository cannot
    take it for PyPI's `kernels` (which transformers imports)."""
    g = graph(type_only=True)
    mods = [m for m in g if m.startswith("inkling_kernels")]
    assert "inkling_kernels.reference" in mods and "inkling_kernels" in mods
    bad = [f"{m} imports {d}" for m in mods for d in sorted(g[m]) if not d.startswith("inkling_kernels")]
    assert not bad, "inkling_kernels must not import inkling_quant:\n" + "\n".join(bad)
    code = ("import sys, importlib.util, inkling_kernels, inkling_kernels.autotune, inkling_kernels.compile_check; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'inkling_quant')); "
            "s = importlib.util.find_spec('kernels'); print(s and s.origin)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    loaded, kernels_origin = (r.stdout.splitlines() + ["", ""])[:2]
    assert r.returncode == 0 and loaded == "[]", r.stdout + r.stderr
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not kernels_origin.startswith(str(ROOT / "kernels")), kernels_origin  # None: PyPI's is not installed


def test_the_checker_sees_imports():
    """The checker itself: it finds a relative, an absolute and a lazy import, and skips TYPE_CHECKING."""
    g = graph()
    assert "inkling_quant.formats" in g["inkling_quant.schemes"]
    assert "inkling_kernels" in g["inkling_quant.verify.numerics"]  # `import inkling_kernels as kernels`, lazy
    assert {"inkling_kernels.errors", "inkling_kernels.formats"} <= g["inkling_kernels.reference"]
    assert layer_of("inkling_quant.formats") < layer_of("inkling_kernels.reference") < layer_of("inkling_quant.schemes")
    assert "inkling_quant.io.checkpoint" in g["inkling_quant.model.inkling2"]  # lazy, inside a function
    assert "inkling_quant.model.inkling2" not in g["inkling_quant.plan.kvcache"]  # under TYPE_CHECKING
    assert layer_of("inkling_quant.io.output") < layer_of("inkling_quant.model.layout") < layer_of("inkling_quant.formats")
    assert layer_of("inkling_quant.convert") == COMMANDS


# The checkpoint form has one home: what a checkpoint is (its family, naming and expert storage)
# is model/'s to answer, what convert writes is export/'s. Elsewhere no code switches on a storage
# kind's or an output form's name, nor tests which config class (which family) it holds.
FORM_HOMES = ("inkling_quant.model", "inkling_quant.export")
KIND_NAMES = {"per_expert", "stacked", "interleaved", "inkling", "modelopt-hf"}
FAMILY_CLASSES = {"Inkling2Config", "MoEConfig", "HFModel"}


def form_switches(path: Path) -> list[str]:
    """`x == "stacked"`-style comparisons with a storage kind or form name, `isinstance(x,
    Inkling2Config)`-style family tests and `.generic` in one file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value in KIND_NAMES for o in operands):
                out.append(f"{path.name}:{node.lineno}: compares with {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            classes = node.args[1] if len(node.args) > 1 else None
            names = {n.id for n in ast.walk(classes) if isinstance(n, ast.Name)} if classes is not None else set()
            if names & FAMILY_CLASSES:
                out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr == "generic":
            out.append(f"{path.name}:{node.lineno}: .generic")
    return out


def test_the_checkpoint_form_is_asked_not_switched_on():
    bad = [s for p in sources() if not module_name(p).startswith(FORM_HOMES)
           for s in form_switches(p)]
    assert not bad, "form or family switches outside model/ and export/ (ask the Layout, the family or the form):\n" \
        + "\n".join(bad)


def test_the_form_checker_sees_switches(tmp_path):
    """The checker itself: it finds each kind of switch, and leaves a question to the model alone."""
    p = tmp_path / "sample.py"
    p.write_text("if lay.experts.kind == 'stacked': pass\n"
                 "if isinstance(cfg, (Inkling2Config, int)): pass\n"
                 "if conf.generic: pass\n"
                 "if lay.experts.stacked and lay.naming is not None: pass\n")
    assert [s.split(":")[1] for s in form_switches(p)] == ["1", "2", "3"]

