"""The import rules of docs/layering.md, read from its rule table and checked by walking every
module's imports (lazy ones inside functions and literal dynamic imports included), plus a fresh
interpreter that imports the server and must not load jax."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOT = REPO / "weld"
DOC = REPO / "docs" / "layering.md"

LAYERS = ["utils", "config", "kernels", "models", "weights", "tokenizer", "engine", "engine (pure)", "engine (host)",
          "server", "bench", "cli", "__init__"]
PURE_ENGINE_FILES = ["__init__", "sequence", "block_manager", "scheduler", "sampling_params", "outputs"]
HOST_ENGINE_FILES = ["batch"]


# ----- the rule table of docs/layering.md -----

@dataclasses.dataclass(frozen=True)
class Rule:
    lives_in: tuple[str, ...]  # paths relative to the repository: a folder ends with "/"
    may_import: frozenset[str]  # weld layers
    forbidden: frozenset[str]  # third-party top-level packages


def parse_rules(text: str) -> dict[str, Rule]:
    """The table whose header starts with `| Layer |`: one row per layer, names in backticks."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"\|\s*Layer\s*\|", line)), None)
    if start is None:
        raise AssertionError(f"{DOC}: no `| Layer | ... |` table")
    rules: dict[str, Rule] = {}
    for line in lines[start + 2:]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        cells = [re.findall(r"`([^`]+)`", cell) for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or len(cells[0]) != 1:
            raise AssertionError(f"{DOC}: bad row {line!r}")
        (layer,), lives_in, may_import, forbidden = cells
        rules[layer] = Rule(tuple(lives_in), frozenset(may_import), frozenset(forbidden))
    return rules


RULES = parse_rules(DOC.read_text())


def _entries(rules: dict[str, Rule]):
    """(dotted module, kind, layer) for every "Lives in" entry; kind: dir, file or init."""
    for layer, rule in rules.items():
        for entry in rule.lives_in:
            if entry.endswith("/"):
                yield entry.rstrip("/").replace("/", "."), "dir", layer
            elif entry.endswith("/__init__.py"):
                yield entry.removesuffix("/__init__.py").replace("/", "."), "init", layer
            else:
                yield entry.removesuffix(".py").replace("/", "."), "file", layer


def layer_of_module(name: str, rules: dict[str, Rule] = RULES) -> str | None:
    """The layer of a dotted weld module (or of a name inside one): the closest "Lives in" match,
    a file or package __init__ beating its folder; None if no row holds it."""
    best, layer = None, None
    for module, kind, row in _entries(rules):
        hit = name == module or (kind != "init" and name.startswith(module + "."))
        score = (module.count("."), kind != "dir")
        if hit and (best is None or score > best):
            best, layer = score, row
    return layer


def layer_of(path: pathlib.Path, rules: dict[str, Rule] = RULES) -> str | None:
    """The layer of a file under weld/ (it need not exist): weld/bench.py and weld/bench/x.py are
    both `bench`, weld/engine/scheduler.py is `engine (pure)`, weld/__init__.py is `__init__`."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return layer_of_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts), rules)


# ----- what a module imports -----

DYNAMIC = {"import_module", "__import__"}  # importlib.import_module, from importlib import import_module, builtins


def scan(path: pathlib.Path) -> tuple[list[tuple[int, list[str]]], list[str]]:
    """(line, the modules it imports) for each import statement or literal dynamic import of
    `path`, and the problems that make its imports uncheckable."""
    tree = ast.parse(path.read_text(), filename=str(path))
    statements, problems = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            statements.append((node.lineno, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom):
            if node.level > 0:
                problems.append(f"line {node.lineno}: relative import (use absolute imports)")
                continue
            names = [node.module]
            if node.module.split(".")[0] == "weld":  # `from weld.engine import llm` imports weld.engine.llm
                names += [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
            statements.append((node.lineno, names))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called not in DYNAMIC:
                continue
            arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                problems.append(f"line {node.lineno}: {called}() of a non-literal name cannot be checked")
                continue
            if arg.value.startswith("."):
                problems.append(f"line {node.lineno}: relative {called}({arg.value!r}) (use absolute names)")
                continue
            names = [arg.value]
            fromlist = node.args[3] if len(node.args) > 3 else next(
                (k.value for k in node.keywords if k.arg == "fromlist"), None)
            if called == "__import__" and isinstance(fromlist, (ast.List, ast.Tuple)):
                names += [f"{arg.value}.{e.value}" for e in fromlist.elts
                          if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            statements.append((node.lineno, names))
    return statements, problems


def violations(path: pathlib.Path, layer: str | None, rules: dict[str, Rule] = RULES) -> list[str]:
    """Every import of `path` that breaks the rules of `layer`, one message each (empty: clean)."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    if layer not in rules:
        return [f"{where}: in no layer of docs/layering.md (layer {layer!r})"]
    rule = rules[layer]
    allowed = set(rule.may_import) | {layer}
    if "engine" in allowed:
        allowed |= {"engine (pure)", "engine (host)"}
    statements, problems = scan(path)
    found = [f"{where}: {problem}" for problem in problems]
    for line, names in statements:
        bad = {}
        for name in names:
            parts = name.split(".")
            if parts[0] == "weld":
                if len(parts) == 1 or parts[1] == "__version__":
                    continue
                target = layer_of_module(name, rules)
                if target not in allowed:
                    bad[name] = f"layer {target}"
            elif parts[0] in rule.forbidden:
                bad[parts[0]] = "forbidden package"
        for name, why in bad.items():  # `from weld.engine import llm`: report weld.engine.llm alone
            if not any(other.startswith(name + ".") for other in bad):
                found.append(f"{where} ({layer}) line {line}: imports {name} ({why})")
    return found


MODULES = sorted(ROOT.rglob("*.py"))


def test_modules_found():
    assert len(MODULES) > 20


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_layer_imports(path):
    assert violations(path, layer_of(path)) == []


# ----- the table itself -----

def test_the_table_has_every_layer_in_order():
    assert list(RULES) == LAYERS
    for i, (layer, rule) in enumerate(RULES.items()):
        assert rule.lives_in, layer
        assert rule.may_import <= set(LAYERS[:i]), f"{layer} may import a layer not above it"
    assert RULES["utils"].may_import == set() and RULES["config"].may_import == {"utils"}
    assert {"jax", "jaxlib"} <= RULES["server"].forbidden and {"jax", "jaxlib"} <= RULES["tokenizer"].forbidden
    assert {"jax", "jaxlib", "numpy"} <= RULES["engine (pure)"].forbidden
    assert "engine" not in RULES["server"].may_import  # only the pure files
    for layer in LAYERS:  # torch and transformers are test-only oracles, except for `weld bench --vs hf`
        assert ({"torch", "transformers"} <= RULES[layer].forbidden) == (layer != "bench"), layer
    assert [f"weld/engine/{name}.py" for name in PURE_ENGINE_FILES] == list(RULES["engine (pure)"].lives_in)
    assert [f"weld/engine/{name}.py" for name in HOST_ENGINE_FILES] == list(RULES["engine (host)"].lives_in)
    assert {"jax", "jaxlib"} <= RULES["engine (host)"].forbidden


def test_layer_of_follows_the_table():
    assert layer_of(ROOT / "bench.py") == layer_of(ROOT / "bench" / "__init__.py") == "bench"
    assert layer_of(ROOT / "bench" / "report.py") == "bench"
    assert layer_of(ROOT / "config.py") == "config" and layer_of(ROOT / "cli.py") == "cli"
    assert layer_of(ROOT / "__init__.py") == "__init__"
    assert layer_of(ROOT / "engine" / "llm.py") == layer_of(ROOT / "engine" / "spec" / "__init__.py") == "engine"
    for name in PURE_ENGINE_FILES:
        assert layer_of(ROOT / "engine" / f"{name}.py") == "engine (pure)", name
    for name in HOST_ENGINE_FILES:
        assert layer_of(ROOT / "engine" / f"{name}.py") == "engine (host)", name
    assert layer_of(ROOT / "models" / "common" / "attention.py") == "models"
    assert layer_of(ROOT / "nowhere.py") is None
    assert layer_of_module("weld.engine") == layer_of_module("weld.engine.scheduler.Scheduler") == "engine (pure)"
    assert layer_of_module("weld.engine.llm") == "engine"


def test_the_pure_and_host_engine_files_exist():
    for name in PURE_ENGINE_FILES + HOST_ENGINE_FILES:
        assert (ROOT / "engine" / f"{name}.py").exists(), name


# ----- the checker can fail -----

@pytest.mark.parametrize("layer,source,expected", [
    ("tokenizer", "import jax\nfrom weld.engine import llm\n", ["imports jax", "imports weld.engine.llm"]),
    ("tokenizer", "import numpy\nfrom weld.utils.errors import WeldError\nfrom weld import __version__\n", []),
    ("utils", "def f():\n    from weld.models import llama\n", ["imports weld.models.llama (layer models)"]),
    ("config", "from weld.utils import errors\n", []),
    ("config", "import jax.numpy as jnp\nfrom weld.engine.sequence import Sequence\n",
     ["imports jax", "imports weld.engine.sequence"]),
    ("engine", "from weld.config import EngineConfig\nfrom weld.models import llama\nimport jax\n", []),
    ("engine", "from weld.server.app import build_app\n", ["imports weld.server.app"]),
    ("engine (pure)", "from weld.engine.sequence import Sequence\nfrom weld.config import X\n", []),
    ("engine (pure)", "import numpy as np\n", ["imports numpy"]),
    ("engine (pure)", "from weld.engine import runner\n", ["imports weld.engine.runner (layer engine)"]),
    ("server", "from weld.engine.outputs import RequestOutput\n", []),
    ("server", "def f():\n    from weld.engine.llm import LLM\n", ["imports weld.engine.llm"]),
    ("server", "import importlib\ndef f():\n    return importlib.import_module('weld.engine.runner')\n",
     ["imports weld.engine.runner"]),
    ("server", "from importlib import import_module\nimport_module('jax')\n", ["imports jax"]),
    ("server", "jnp = __import__('jax.numpy')\n", ["imports jax"]),
    ("server", "m = __import__('weld.engine', fromlist=['runner'])\n", ["imports weld.engine.runner "]),
    ("server", "import importlib\nname = 'jax'\nimportlib.import_module(name)\n", ["non-literal"]),
    ("server", "__import__(f'weld.{x}')\n", ["non-literal"]),
    ("server", "import importlib\nimportlib.import_module('.app', 'weld.server')\n", ["relative"]),
    ("kernels", "from . import cpu\n", ["relative import"]),
    ("cli", "import transformers\n", ["imports transformers"]),
    ("bench", "import torch, transformers\nfrom weld.engine.llm import LLM\n", []),
    ("bench", "from weld.server import app\n", ["imports weld.server.app"]),
    ("__init__", "def __getattr__(n):\n    from weld.engine.llm import LLM\n    from weld.config import C\n", []),
    ("nonsense", "import os\n", ["in no layer"]),
])
def test_the_checker_reports_violations(tmp_path, layer, source, expected):
    bad = tmp_path / "module.py"
    bad.write_text(source)
    found = violations(bad, layer)
    assert len(found) == len(expected), found
    for message, needle in zip(found, expected):
        assert needle in message + " ", found


def test_the_checker_reads_the_document(tmp_path):
    """A rule changed in the document changes the verdict: the table is the source of truth."""
    text = DOC.read_text()
    row = "| `server` | `weld/server/` | `engine (pure)`,"
    assert row in text
    loose = parse_rules(text.replace(row, "| `server` | `weld/server/` | `engine`,"))
    bad = tmp_path / "module.py"
    bad.write_text("from weld.engine.llm import LLM\n")
    assert violations(bad, "server") != [] and violations(bad, "server", loose) == []
    with pytest.raises(AssertionError, match="no `| Layer"):
        parse_rules(text.replace("| Layer |", "| Name |"))


# ----- the server never loads jax, transitively -----

PROBE = """
import importlib, json, pkgutil, sys
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
        importlib.import_module(info.name)
print(json.dumps({"imported": sorted(m for m in sys.modules if m.startswith("weld")),
                  "runtimes": sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib"))}))
"""


def loaded_in_fresh_interpreter(*modules: str) -> dict:
    """Imports `modules` (and, for packages, every module under them) in a new interpreter."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_server_never_loads_jax():
    """Every module of weld/server (the app first), and the pure engine files it uses."""
    pure = [f"weld.engine.{name}" for name in PURE_ENGINE_FILES if (ROOT / "engine" / f"{name}.py").exists()]
    seen = loaded_in_fresh_interpreter("weld.server.app", "weld.server", *pure)
    server_files = {p.stem for p in (ROOT / "server").glob("*.py")} - {"__init__"}
    assert {f"weld.server.{name}" for name in server_files} <= set(seen["imported"])
    assert seen["runtimes"] == []


def test_the_probe_sees_jax():
    """The probe can fail: a module that does import jax shows it."""
    assert "jax" in loaded_in_fresh_interpreter("weld.kernels.cpu")["runtimes"]
