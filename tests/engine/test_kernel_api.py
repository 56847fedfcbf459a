"""The engine uses the kernels only through the package's public API: no module of dinfer/ outside
dinfer/train/ (which trains against the references on purpose) imports dinfer_kernels.reference, in
any form (import, from-import, or the attribute of an imported dinfer_kernels). The decode defaults,
rules and sampling keys the engine needs come from the package face (dinfer_kernels/__init__.py)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = "dinfer_kernels.reference"


def _reference_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every use of dinfer_kernels.reference in a module's syntax tree."""
    found, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == REFERENCE or a.name.startswith(REFERENCE + "."):
                    found.append((node.lineno, f"import {a.name}"))
                elif a.name == "dinfer_kernels":
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == REFERENCE or node.module.startswith(REFERENCE + "."):
                found.append((node.lineno, f"from {node.module} import ..."))
            elif node.module == "dinfer_kernels" and any(a.name == "reference" for a in node.names):
                found.append((node.lineno, "from dinfer_kernels import reference"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "reference"
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            found.append((node.lineno, f"{node.value.id}.reference"))
    return found


def test_the_finder_sees_every_form():
    """The check itself: each way of reaching the references is found, the package face is not."""
    code = (
        "import dinfer_kernels as dk\n"
        "import dinfer_kernels.reference.rng\n"
        "from dinfer_kernels.reference.decode import DEFAULTS\n"
        "from dinfer_kernels import reference, sequence_key\n"
        "x = dk.reference.rng\n"
        "y = dk.DECODE_DEFAULTS\n"
    )
    assert [line for line, _ in _reference_imports(ast.parse(code))] == [2, 3, 4, 5]


def test_engine_does_not_import_the_references():
    offenders = []
    for path in sorted((ROOT / "dinfer").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] == "train":
            continue
        for line, what in _reference_imports(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{rel}:{line}: {what}")
    assert offenders == [], "dinfer/ reaches past the op layer:\n" + "\n".join(offenders)
