"""A wheel must carry every file the native CPU kernels are built from: a missing header fails the
build on the user's machine, and weld then falls back to the slower XLA path with a warning."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from weld.kernels import cpu as cpu_kernels


def test_package_data_covers_every_kernel_source_and_header():
    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["weld.kernels.cpu"]
    needed = cpu_kernels._SOURCES + cpu_kernels._HEADERS
    here = Path(cpu_kernels.__file__).parent
    assert all((here / name).is_file() for name in needed)
    missing = [name for name in needed if not any(fnmatch.fnmatch(name, p) for p in shipped)]
    assert not missing, f"pyproject.toml package-data leaves out {missing}"
    # every include of a local header is one the build key and the wheel know about
    for source in cpu_kernels._SOURCES:
        for line in (here / source).read_text().splitlines():
            if line.startswith('#include "') and not line.startswith('#include "xla/'):
                assert line.split('"')[1] in cpu_kernels._HEADERS, line
