"""The package's shape (docs/architecture.md): no import circles, one face per package, pure layout math,
and every public name the docs use still importable."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fsdp_optim"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere (top level, functions, type-checking blocks)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `from .x import name`: the module is x
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    # A package's __init__ (its face) imports its modules; a module importing its own package's face back
    # would be a circle too, and is caught here like any other.
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_optimizers_import_only_the_optimizer_authors_face():
    graph = _graph()
    reach_ins = {
        (m, t)
        for m, ts in graph.items()
        if m.startswith("fsdp_optim.optimizers")
        for t in ts
        if t.startswith("fsdp_optim.sharding") and t != "fsdp_optim.sharding.contract"
    }
    assert not reach_ins, f"optimizers must import from fsdp_optim.sharding.contract only: {sorted(reach_ins)}"


def test_each_audience_has_its_face():
    """Users, optimizer authors and planning each import one module; the faces do not re-export one
    another wholesale (a name on two faces is one the two audiences share: the block rules)."""
    import fsdp_optim.sharding as users
    from fsdp_optim.sharding import contract, plan

    shared = {"BlockRule", "BlockSpec", "elements", "expert", "heads", "rows", "whole"}
    assert set(users.__all__) & set(contract.__all__) <= shared | {"RaggedDTensor", "is_ragged"}
    assert len(users.__all__) <= 30 and len(contract.__all__) <= 20, "a face grew: is every name for its audience?"
    assert "plan_model" in plan.__all__ and "plan_model" not in users.__all__ and "fully_shard" not in plan.__all__
    for name, home in users._MOVED.items():  # pre-0.2.0 names still resolve, with a warning naming the new home
        with pytest.warns(DeprecationWarning, match=home.replace(".", r"\.")):
            obj = getattr(users, name)
        assert obj is getattr(importlib.import_module(home), name)
        assert name not in users.__all__
    with pytest.raises(AttributeError):
        users.no_such_name  # noqa: B018


def test_layout_math_is_pure():
    # sharding/plan: shapes in, layouts out; no process group, no runtime module.
    for name, path in _modules().items():
        if not name.startswith("fsdp_optim.sharding.plan"):
            continue
        text = path.read_text()
        assert "torch.distributed" not in text, f"{name} imports torch.distributed"
        outside = {t for t in _graph()[name] if not t.startswith("fsdp_optim.sharding.plan")}
        assert not outside, f"{name} imports {sorted(outside)} from outside sharding/plan"


# The public names as of the DTensor parameters (issue #34; ShardInfo / shard_info / global_shape /
# to_dtensor / from_dtensor went with the flat parameters they described), per face: each must keep working.
_PUBLIC = {
    "fsdp_optim": [
        "Float8AllGather", "MixedPrecisionPolicy", "ShardedModule", "clip_grad_norm_", "export_hf",
        "full_state_dict", "fully_shard", "init_weights", "load_checkpoint", "load_full_state_dict",
        "load_hf", "param_groups", "save_checkpoint", "sharded_plan", "sharding", "testing",
    ],
    "fsdp_optim.optimizers": [
        "AdamW", "AdamW4bit", "AdamW8bit", "Muon", "SOAP", "Shampoo", "WholeTensorOptimizer", "adamw8bit_rule",
        "adamw_rule", "adamw_update", "is_embedding_or_head", "muon_rule", "shampoo_rule", "whole_tensor_rule",
    ],
    "fsdp_optim.sharding": [
        "BlockRule", "BlockSpec", "ExpertGroups", "ExpertShard", "Float8AllGather", "MixedPrecisionPolicy",
        "PlanConfig", "RaggedDTensor", "RaggedShard", "ShardedModule", "clip_grad_norm_", "contract", "default_rule",
        "distribute_ragged", "elements", "expert", "expert_parallel", "expert_parallel_groups", "expert_shard",
        "fully_shard", "grouped_linear", "heads", "init_weights", "is_ragged", "plan", "rows", "sharded_plan",
        "suggest_mesh", "whole",
    ],
    "fsdp_optim.sharding.contract": [
        "BlockKind", "BlockRule", "BlockSpec", "LocalShard", "OwnedState", "RaggedDTensor", "ShardedState",
        "check_not_replaced", "elements", "expert", "heads", "is_ragged", "local_shard", "local_tensor",
        "materialize_all", "merge_small_dims", "register_optimizer_hooks", "rows", "whole",
    ],
    "fsdp_optim.sharding.plan": [
        "BlockKind", "BucketPlan", "Layout", "MeshCandidate", "MeshSuggestion", "Placement", "Plan", "PlanConfig",
        "PlanStats", "RaggedLayout", "TensorSpec", "block_aligned_splits", "chunk_bounds", "expert_ranges",
        "merge_small_dims", "plan_model", "suggest_mesh", "tensor_cost",
    ],
    "fsdp_optim.testing": [
        "CollectiveCounts", "DistributedTestError", "MeshResult", "ShardedCheckReport", "check_sharded_equals_unsharded",
        "count_collectives", "emulated_mesh", "make_sharded_param", "run_distributed", "sharded_grad",
    ],
}


@pytest.mark.parametrize("module", sorted(_PUBLIC))
def test_public_names_keep_working(module):
    mod = importlib.import_module(module)
    missing = [n for n in _PUBLIC[module] if not hasattr(mod, n)]
    assert not missing, f"{module} lost {missing}"
    unlisted = [n for n in _PUBLIC[module] if n not in getattr(mod, "__all__", ())]
    assert not unlisted, f"{module}.__all__ misses {unlisted}"


def _names_in_docs() -> set[str]:
    """Every ``fsdp_optim.x.y`` the README, docs, recipes and examples mention, and every name their Python
    code (files, and ```python blocks of the Markdown pages) imports from ``fsdp_optim``."""
    pages = [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    code = [p.read_text() for p in sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "recipes").glob("*.py"))]
    names: set[str] = set()
    for page in pages:
        text = page.read_text()
        names |= set(re.findall(r"\bfsdp_optim(?:\.[A-Za-z_]\w*)+", text))
        code += re.findall(r"```python\n(.*?)```", text, flags=re.S)
    for text in code:
        names |= set(re.findall(r"\bfsdp_optim(?:\.[A-Za-z_]\w*)+", text))
        try:
            tree = ast.parse(text)
        except SyntaxError:  # a fragment
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_optim") and not node.level:
                names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_every_name_the_docs_use_imports():
    bad = []
    for dotted in sorted(_names_in_docs()):
        parts = dotted.split(".")
        if parts[1].startswith("_") or parts[-1] in ("py", "json", "md"):  # private modules, file names
            continue
        obj = importlib.import_module("fsdp_optim")
        for i, part in enumerate(parts[1:], 1):
            if part in getattr(obj, "_MOVED", {}):  # a pre-0.2.0 name: the docs name its new face
                bad.append(f"{dotted} (moved to {obj._MOVED[part]})")
                break
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                bad.append(dotted)
                break
    assert not bad, f"names in the README/docs/examples that do not import: {bad}"


MAX_MODULE_LINES = 1000


_NOTE_DEF = re.compile(r'^\s*(?:#\s*|"""|r""")?\[Note: ([^\]]+)\]', re.M)


def _note_definitions() -> dict[str, set[str]]:
    """Every ``[Note: NAME]`` that opens a line (a comment or a docstring: a definition, not a
    "see [Note: ...]"), name -> the files (relative to ``fsdp_optim/``) defining it."""
    found: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for name in _NOTE_DEF.findall(path.read_text()):
            found.setdefault(name, set()).add(path.relative_to(PKG).as_posix())
    return found


def test_the_note_map_matches_the_code():
    """docs/architecture.md's map names every note the code defines, each in the file that defines it,
    and no note the code no longer has."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## Map of the"):].split("\n## ", 1)[0]
    mapped = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] not in ("note", "---"):
            mapped[cells[0]] = cells[1].strip("`")
    defined = _note_definitions()
    assert defined, "no [Note: ...] definitions found: the pattern is wrong"
    missing = sorted(set(defined) - set(mapped))
    stale = sorted(set(mapped) - set(defined))
    wrong = sorted(f"{n}: map says {f}, defined in {sorted(defined[n])}" for n, f in mapped.items()
                   if n in defined and f not in defined[n])
    assert not (missing or stale or wrong), f"note map: missing {missing}, stale {stale}, wrong file {wrong}"


def test_every_module_is_under_1000_lines():
    """One concept per file (docs/architecture.md): a module of 1,000 lines or more is two concepts; split it
    (by concept, not by squashing lines)."""
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) >= MAX_MODULE_LINES}
    assert not long, f"modules of >= {MAX_MODULE_LINES} lines (split them): {long}"


def _third_party_imports(paths) -> set[str]:
    """Top-level names of the modules the files import that are neither the standard library nor ours."""
    out: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                out.add(node.module.split(".")[0])
    return {m for m in out if m not in sys.stdlib_module_names and m not in ("fsdp_optim", "__future__")}


def test_core_dependencies_are_what_the_library_imports():
    """pyproject's ``dependencies`` are exactly the library's imports; the recipes' and benchmarks' needs
    (matplotlib, tqdm, einops, ...) are extras (issue 37)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the backport (a dev dependency there)
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower().replace("-", "_") for r in project["dependencies"]}
    assert declared == _third_party_imports(PKG.rglob("*.py"))


def test_the_library_holds_only_code():
    """Data the recipes read lives with the recipes (recipes/corpus/), not in the installed package."""
    assert sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")) == []
