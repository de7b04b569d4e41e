"""docs/structure.md names every file of the package (a file added without a line there fails here)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def listed(doc: str) -> set[str]:
    """Paths the doc names: full paths, files on an indented line under a folder's line, and files
    named beside another file of their folder (on its line or the lines that continue it)."""
    names, folder, here = set(), None, ""
    for line in doc.splitlines():
        words = line.split()
        if not words:
            continue
        if line.startswith("mashbox/"):
            path = words[0]
            folder = path if path.endswith("/") else None
            names.add(path)
            here = path if path.endswith("/") else path.rsplit("/", 1)[0] + "/"
            words = words[1:]
        elif line.startswith("  ") and folder:
            names.add(folder + words[0])
        names.update(here + w.strip("(),;:") for w in words if "." in w)  # files named beside it
    return names


def test_every_file_of_the_package_is_in_the_structure_doc():
    doc = (ROOT / "docs" / "structure.md").read_text()
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "mashbox").rglob("*")
             if p.is_file() and p.name != "__init__.py" and "__pycache__" not in p.parts}
    missing = sorted(files - listed(doc))
    assert not missing, f"docs/structure.md does not name: {', '.join(missing)}"
    assert {"mashbox/engine/model/kernels.c", "mashbox/ui/app.js"} <= files  # the walk sees the package


def _imports(path: Path) -> set[str]:
    """The mashbox modules a file imports, type-checking-only imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mashbox"):
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mashbox")}
    return found


def test_no_two_modules_of_a_layer_import_each_other_in_a_circle():
    """Within each folder of the package, a module's imports never lead back to it (each protocol's
    Translator lives in its protocol's module, beside nothing that imports that module back)."""
    for folder in sorted({p.parent for p in (ROOT / "mashbox").rglob("*.py")}):
        package = ".".join(folder.relative_to(ROOT).parts)
        modules = {f"{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
        edges = {name: _imports(path) & modules.keys() for name, path in modules.items()}
        for start in edges:
            seen, todo = set(), list(edges[start])
            while todo:
                name = todo.pop()
                assert name != start, f"{start} imports itself through {sorted(seen)}"
                if name not in seen:
                    seen.add(name)
                    todo += edges[name]
