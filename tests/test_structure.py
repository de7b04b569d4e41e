"""docs/structure.md names every file of the package (a file added without a line there fails here)."""

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
