"""The import rules of DESIGN.md, checked by walking every module's imports (including lazy ones)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "weld"

# layer -> the weld layers it may import (itself always allowed)
ALLOWED = {
    "utils": set(),
    "kernels": {"utils"},
    "models": {"kernels", "utils"},
    "weights": {"models", "utils"},
    "tokenizer": {"utils"},
    "engine": {"models", "weights", "kernels", "tokenizer", "utils"},
    "server": {"engine", "tokenizer", "utils"},
    "bench": {"utils", "kernels", "models", "weights", "tokenizer", "engine"},
    "cli": {"utils", "kernels", "models", "weights", "tokenizer", "engine", "server", "bench"},
    "__init__": {"engine"},
}
# Third-party packages a layer must never import.
FORBIDDEN_PACKAGES = {
    "utils": {"jax", "jaxlib", "torch", "transformers"},
    "tokenizer": {"jax", "jaxlib", "gguf", "torch", "transformers"},
    "server": {"jax", "jaxlib", "torch", "transformers"},
}
# Engine files that are pure Python: no jax, and only pure weld modules.
PURE_ENGINE = {"sequence", "block_manager", "scheduler", "sampling_params", "outputs", "__init__"}
ANYWHERE_FORBIDDEN = {"torch", "transformers"}  # test-only oracles
COMPETITORS_ALLOWED_IN = {"bench"}  # `weld bench --vs hf` runs transformers on purpose


def layer_of(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else "__init__"


def imports_of(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            if node.module == "weld":
                names += [f"weld.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}: use absolute imports (found a relative import)")
    return names


MODULES = sorted(ROOT.rglob("*.py"))


def test_modules_found():
    assert len(MODULES) > 20


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_layer_imports(path):
    layer = layer_of(path)
    allowed = ALLOWED[layer] | {layer}
    for name in imports_of(path):
        top = name.split(".")[0]
        if top == "weld":
            parts = name.split(".")
            if len(parts) == 1:
                continue
            target = parts[1]
            if target == "__version__" or (layer == "cli" and target in ("__version__",)):
                continue
            assert target in allowed, f"{path.relative_to(ROOT)} ({layer}) imports {name}"
        else:
            if layer not in COMPETITORS_ALLOWED_IN:
                assert top not in ANYWHERE_FORBIDDEN, f"{path.relative_to(ROOT)} imports test-only {top}"
            assert top not in FORBIDDEN_PACKAGES.get(layer, set()), f"{path.relative_to(ROOT)} ({layer}) imports {top}"


@pytest.mark.parametrize("name", sorted(PURE_ENGINE))
def test_pure_engine_never_imports_jax(name):
    path = ROOT / "engine" / f"{name}.py"
    for imported in imports_of(path):
        assert imported.split(".")[0] not in ("jax", "jaxlib", "numpy"), f"engine/{name}.py imports {imported}"
        if imported.startswith("weld.engine."):
            assert imported.split(".")[2] in PURE_ENGINE, f"engine/{name}.py imports non-pure {imported}"
        elif imported.startswith("weld."):
            assert imported.split(".")[1] == "utils", f"engine/{name}.py imports {imported}"


def test_rule_catches_a_violation(tmp_path):
    """The checker itself can fail: a tokenizer module importing jax is flagged."""
    bad = tmp_path / "bad.py"
    bad.write_text("import jax\nfrom weld.engine import llm\n")
    names = imports_of(bad)
    assert "jax" in names and "weld.engine" in names
    assert "jax" in FORBIDDEN_PACKAGES["tokenizer"] and "engine" not in ALLOWED["tokenizer"]
