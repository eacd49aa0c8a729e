"""Run the specserve command line from another source tree (an export of some revision), for
`sweep --variant`: the same sweep can then time two versions of the engine side by side.

    python -m benchmarks.serve_tree TREE serve --config configs/tiny.toml --port 8765 ...

TREE is a directory laid out like this repository (its pyproject.toml says where each
`specserve.*` package lives). Every `specserve` import of this process resolves inside TREE,
whatever is installed; its dependencies come from the environment as usual.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import tomllib
from pathlib import Path


def package_dirs(tree: Path) -> dict[str, Path]:
    """{package name: its directory in tree}: `specserve` and the package-dir entries of the
    tree's pyproject.toml (specserve.kernels -> kernels, ...)."""
    pyproject = tree / "pyproject.toml"
    if not pyproject.is_file():
        raise SystemExit(f"serve_tree: {tree} has no pyproject.toml (not a specserve source tree)")
    setuptools = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {})
    dirs = {"specserve": tree / "specserve"}
    dirs.update({name: tree / path for name, path in setuptools.get("package-dir", {}).items() if name})
    missing = [name for name, d in dirs.items() if not (d / "__init__.py").is_file()]
    if missing:
        raise SystemExit(f"serve_tree: {tree} lacks the package(s) {', '.join(missing)}")
    return dirs


class _TreeFinder(importlib.abc.MetaPathFinder):
    """Finds the mapped packages in the tree; their modules then load from the packages'
    own __path__ as usual."""

    def __init__(self, dirs: dict[str, Path]):
        self.dirs = dirs

    def find_spec(self, name, path=None, target=None):
        d = self.dirs.get(name)
        if d is None:
            return None
        return importlib.util.spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])


def use_tree(tree: Path) -> None:
    """Make every later `import specserve...` of this process resolve inside tree."""
    if any(name == "specserve" or name.startswith("specserve.") for name in sys.modules):
        raise RuntimeError("serve_tree: specserve is already imported in this process")
    sys.meta_path.insert(0, _TreeFinder(package_dirs(tree.resolve())))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m benchmarks.serve_tree TREE [specserve arguments ...]")
    use_tree(Path(argv[0]))
    from specserve import cli

    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
