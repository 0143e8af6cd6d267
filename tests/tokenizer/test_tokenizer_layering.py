"""weld/tokenizer imports only weld.utils, the stdlib and tokenizers / jinja2 / numpy."""

import ast
import pathlib
import sys

import weld.tokenizer

ALLOWED_THIRD_PARTY = {"tokenizers", "jinja2", "numpy"}


def _imported_modules(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


def test_tokenizer_imports_only_allowed_layers():
    folder = pathlib.Path(weld.tokenizer.__file__).parent
    files = sorted(folder.rglob("*.py"))
    assert len(files) >= 5
    for path in files:
        for module in _imported_modules(path):
            top = module.split(".")[0]
            if top == "weld":
                assert module.startswith(("weld.utils", "weld.tokenizer")), f"{path.name} imports {module}"
            else:
                assert top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY, f"{path.name} imports {module}"
