"""The package's shape, read from the source with ast (docs/architecture.md draws it):
imports run one way between the top-level packages and modules (imports inside functions
count), no `_private` name is imported from another package, modules stay at most 400
lines, and no module is named `*_more` / `*_other`.

The allow-lists below hold the violations still in the code, each with its reason; they may
only shrink: a violation not listed fails, and a listed one that is gone fails too, so the
entry is removed with the fix."""
from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).parents[1] / "src" / "vramplan"

# The import order, lowest first: a unit (top-level module or package of vramplan) may import
# only units listed before it. "vramplan" is the package's __init__ (the public API),
# "__main__" is `python -m vramplan`.
ORDER = (
    # leaves: import nothing of ours but each other
    "units", "breakdown", "files", "i18n", "model", "timeline",
    # the validated job
    "spec",
    # the model catalog's data and the built-in config adapters (catalog/hf*); raw sizes;
    # importers turn other tools' files (DeepSpeed JSON, TrainingArguments, recipes) into spec data
    "catalog", "rawsize", "importers",
    # the terms of one model's step; the family folders (families/<name>/: adapter and forward,
    # the registry model_type -> folder) build on catalog/hf* and components/arch*; a family's
    # description brings its forward (FamilyDesc.family_forward), so components/ never imports one
    "components", "validity", "families",
    # where a model comes from (catalog name, path, hub id, config): the one dispatcher from a
    # config to a ModelDesc, over catalog/hf* and every family's adapter
    "sources",
    # sharding per rank, the caching-allocator model, the step's tensor events; device levels
    "parallel", "allocator", "step", "bounds", "device",
    # renderers take results duck-typed, so the results' notebook display (_repr_html_) may call them
    "report",
    # the result, the multi-model jobs, the one dispatcher
    "result", "jobs", "estimation",
    # the tables of `vramplan models` / `gpus` and the web API's lists (parameter counts of
    # multi-model entries come from jobs/)
    "listing",
    # many specs -> estimate() -> rank; the local-GPU check
    "plan", "check",
    # the public API
    "vramplan",
    # edges: the Trainer callback, the measurement branch (real libraries), the web page (its
    # server and API; `vramplan serve` in cli/ starts it), the command line
    "integrations", "measure", "web", "cli", "__main__",
)

# (importing unit, imported unit, module path relative to src/vramplan): reason.
IMPORT_ORDER_ALLOWED: dict[tuple[str, str, str], str] = {}

# module path relative to src/vramplan: reason. Over 400 lines.
LONG_MODULES_ALLOWED: dict[str, str] = {}

# module path: reason. Named *_more / *_other.
NAMES_ALLOWED: dict[str, str] = {}

MAX_LINES = 400


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        parts = ["vramplan", *rel.with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        yield rel.as_posix(), parts, is_pkg, path


def _unit(dotted: str) -> str | None:
    parts = dotted.split(".")
    if parts[0] != "vramplan":
        return None
    return parts[1] if len(parts) > 1 else "vramplan"


def _units() -> set[str]:
    return {p.stem if p.is_file() else p.name for p in PKG.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}


def _imports(parts: list[str], is_pkg: bool, tree: ast.AST):
    """(imported module, names taken from it, line) for every import of the module, at any
    depth (inside functions too), plus __import__ / importlib.import_module of a constant."""
    units = _units()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts if is_pkg else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [a.name for a in node.names]
            if module == "vramplan":  # `from vramplan import x`: a submodule, or a name of the API
                for name in names:
                    yield (f"vramplan.{name}", [], node.lineno) if name in units else ("vramplan", [name], node.lineno)
            else:
                yield module, names, node.lineno
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "id", None) == "__import__" or getattr(node.func, "attr", None) == "import_module")):
            yield node.args[0].value, [], node.lineno


def _parsed():
    for rel, parts, is_pkg, path in _modules():
        yield rel, parts, is_pkg, ast.parse(path.read_text(), filename=str(path))


def _unit_of_file(parts: list[str]) -> str:
    return _unit(".".join(parts))


def test_every_unit_has_a_place_in_the_order():
    missing = sorted(_units() - set(ORDER))
    assert missing == [], f"place these top-level modules/packages in ORDER: {missing}"


def test_imports_run_one_way():
    rank = {u: i for i, u in enumerate(ORDER)}
    found, seen = [], set()
    for rel, parts, is_pkg, tree in _parsed():
        src = _unit_of_file(parts)
        for module, _names, line in _imports(parts, is_pkg, tree):
            dst = _unit(module)
            if dst is None or dst == src or dst not in rank or src not in rank:
                continue
            if rank[dst] > rank[src]:
                key = (src, dst, rel)
                seen.add(key)
                if key not in IMPORT_ORDER_ALLOWED:
                    found.append(f"{rel}:{line} ({src}) imports {module} ({dst}), which comes later in ORDER")
    assert found == []
    stale = sorted(set(IMPORT_ORDER_ALLOWED) - seen)
    assert stale == [], f"fixed: remove from IMPORT_ORDER_ALLOWED: {stale}"


def test_measure_is_a_branch_the_core_never_imports():
    found = []
    for rel, parts, is_pkg, tree in _parsed():
        src = _unit_of_file(parts)
        if src in ("measure", "cli", "__main__"):
            continue
        found += [f"{rel}:{line} imports {module}" for module, _n, line in _imports(parts, is_pkg, tree)
                  if _unit(module) == "measure"]
    assert found == []


def test_no_private_name_imported_from_another_package():
    found = []
    for rel, parts, is_pkg, tree in _parsed():
        src = _unit_of_file(parts)
        for module, names, line in _imports(parts, is_pkg, tree):
            dst = _unit(module)
            if dst is None or dst == src:
                continue
            # `_` alone is gettext's translation function (vramplan.i18n), public by convention
            private = [n for n in names if n.startswith("_") and not n.startswith("__") and n != "_"]
            private += [p for p in module.split(".") if p.startswith("_") and not p.startswith("__")]
            if private:
                found.append(f"{rel}:{line} imports {private} from {module}")
    assert found == []


def test_modules_stay_short():
    lengths = {rel: len(path.read_text().splitlines()) for rel, _p, _k, path in _modules()}
    long = sorted(f"{rel}: {n} lines" for rel, n in lengths.items() if n > MAX_LINES and rel not in LONG_MODULES_ALLOWED)
    assert long == [], f"split these modules by idea (at most {MAX_LINES} lines)"
    stale = sorted(rel for rel in LONG_MODULES_ALLOWED if lengths.get(rel, 0) <= MAX_LINES)
    assert stale == [], f"now short enough: remove from LONG_MODULES_ALLOWED: {stale}"


def test_modules_are_named_by_idea():
    named = {rel for rel, _p, _k, _path in _modules()
             if pathlib.PurePosixPath(rel).stem.endswith(("_more", "_other"))}
    assert sorted(named - set(NAMES_ALLOWED)) == [], "name the module by what it holds, not *_more / *_other"
    assert sorted(set(NAMES_ALLOWED) - named) == [], "renamed: remove from NAMES_ALLOWED"


def test_the_checks_see_imports_inside_functions():
    """The walk finds a function-level import and a relative one (the checks above would
    pass vacuously if it found none)."""
    tree = ast.parse("def f():\n    from vramplan.cli.main import main\nfrom .jobs import x\n")
    found = [m for m, _n, _l in _imports(["vramplan", "measure", "ppo"], False, tree)]
    assert sorted(found) == ["vramplan.cli.main", "vramplan.measure.jobs"]
