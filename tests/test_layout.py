"""The package's layout rules: small modules and functions (import direction is checked by ``lint-imports``,
with the layers contract in pyproject.toml)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "unipg"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def test_no_module_is_over_400_lines():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these modules along a seam: {long}"


def test_no_function_is_over_60_lines():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], f"split these functions into named steps: {long}"


def test_the_layers_contract_names_every_top_level_room():
    import tomllib

    contract = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    rooms = {f"unipg.{path.name}" for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    rooms |= {f"unipg.{path.stem}" for path in PACKAGE.glob("*.py") if not path.stem.startswith("_")}
    layers = {room.strip() for layer in contract["layers"] for room in layer.split("|")}
    assert layers == rooms


def test_the_package_front_doors_private_modules_import_nothing_of_unipg():
    """``unipg/_compat.py`` and ``unipg/_moved.py`` serve ``unipg/__init__.py`` alone and stay outside the layers."""
    for path in PACKAGE.glob("_*.py"):
        if path.stem == "__init__":
            continue
        imported = [
            node
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("unipg")
            or isinstance(node, ast.Import)
            and any(a.name.startswith("unipg") for a in node.names)
        ]
        assert imported == [], path.name
