"""The suite's own layout: pytest imports test modules by basename here (no packages under tests/),
so two test files with one name break collection on a clean checkout (a stale module wins)."""

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def test_test_module_basenames_are_unique():
    names = collections.defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name.startswith("test_"):
            names[path.name].append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def test_slow_variants_name_existing_tests():
    from tests.conftest import SLOW_VARIANTS

    for nodeid in SLOW_VARIANTS:
        path, name = nodeid.split("::")
        source = (TESTS.parent / path).read_text()
        assert f"def {name.split('[')[0]}(" in source, f"tests/conftest.py SLOW_VARIANTS: {nodeid} names no test"
