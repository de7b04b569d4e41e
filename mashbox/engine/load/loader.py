"""Load a model (catalog id, HF model directory or ``.gguf`` file), offline.

``load()`` resolves the argument through the catalog, picks the device (CUDA + bfloat16 when a GPU
is there, else CPU + float32), reads the tokenizer (``text.tokenizer``: its ``tokenizer.json`` with
``tokenizers``, no transformers) and the weights as a ``Checkpoint``: a GGUF's straight from the
memory-mapped file (``gguf_file.py``: its matrices as the file's own blocks), an HF directory's
safetensors directly (transformers builds the model only for what it alone can read), with
``local_files_only=True``, naming each step to a ``step`` callback as it begins
(``mashbox.engine.load.progress`` shows them). transformers is imported only where it is needed (a
GGUF's first load, a directory without ``tokenizer.json`` or safetensors), and its logging, warnings
and tqdm bars are silenced while it runs.

A GGUF holds its vocabulary, not a ``tokenizer.json``: its first load converts it with transformers
(seconds) and saves the result under ``<cache>/converted/`` (keyed by file path, size and mtime);
later loads read that. Each copy names the GGUF it was made from; saving one removes the copies
whose GGUF is gone or changed since, and those an older mashbox made (which held the whole model
dequantized, ~4 bytes a weight).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # mashbox never fetches from a model hub

import torch  # noqa: E402

from mashbox.engine.load import checkpoint, gguf_file  # noqa: E402
from mashbox.engine.load.catalog import ModelSource, cache_dir, corrupt_message, readable, resolve, stamp  # noqa: E402
from mashbox.engine.model import native  # noqa: E402
from mashbox.engine.model.form import pick_dtype  # noqa: E402
from mashbox.engine.text.template import FALLBACKS  # noqa: E402
from mashbox.engine.text.tokenizer import Tokenizer  # noqa: E402
from mashbox.errors import ModelLoadError  # noqa: E402

TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges*", "*.model", "*.tiktoken")  # what transformers makes one of

if TYPE_CHECKING:
    import transformers

CTX_CAP = 8192
_DONE = "complete"  # marker file in a converted directory, written last
ABANDONED_S = 24 * 3600.0  # a converted directory unfinished and untouched this long: its save was cut off
_SOURCE = "source.json"  # the GGUF a converted directory was made from: its path and stamp
_COPIED = ("tokenizer.json", "tokenizer_config.json")  # what a complete converted directory holds
log = logging.getLogger("mashbox.engine")


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: its checkpoint on ``device``, in ``dtype``."""

    id: str
    checkpoint: checkpoint.Checkpoint
    tokenizer: Tokenizer
    weights: str
    bpw: float
    gb: float
    ctx_default: int
    device: torch.device
    dtype: torch.dtype


def load(model: str, *, device: str | torch.device | None = None,
         dtype: str | torch.dtype | None = None, step: Callable[[str], None] = lambda _what: None) -> LoadedModel:
    """Load ``model`` (catalog id, HF directory or .gguf path); raise ModelLoadError if it can't.
    ``step(what)`` is called as each step begins.

    A cached tokenizer copy that does not read (truncated, overwritten) is reported, removed and
    built again from the GGUF."""
    source = resolve(model)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    converted = converted_dir(source)
    try:
        return _load(source, converted, dev, dt, step)
    except _CacheUnreadable as err:
        log.warning("%s; building it again from '%s'", err, source.path)
        shutil.rmtree(converted, ignore_errors=True)
        return _load(source, converted, dev, dt, step)


class _CacheUnreadable(ModelLoadError):
    """A file of the converted copy in the cache does not read."""


def _load(source: ModelSource, converted: Path | None, dev: torch.device, dt: torch.dtype,
          step: Callable[[str], None]) -> LoadedModel:
    if source.kind == "gguf":
        gguf = gguf_file.open_model(source.path)  # read once; a file it cannot run is refused before anything else
        tokenizer = _gguf_tokenizer(source, converted, step, gguf)
        step("mapping the weights")
        ckpt = gguf_file.checkpoint(gguf, dev, dt, native.load())
        size = source.path.stat().st_size
    else:
        _refuse_unknown(source.path)
        step("reading the tokenizer")
        tokenizer = _load_tokenizer(source)
        step("reading the weights")
        ckpt = _read_checkpoint(source, dev, dt)
        if ckpt is None:
            with _hush():
                ckpt = checkpoint.Checkpoint.from_model(_load_model(source, dt).to(dev))
        size = ckpt.nbytes
    _check_vocab(tokenizer, ckpt)
    return LoadedModel(source.id, ckpt, tokenizer, str(source.path), _bpw(source, ckpt), size / 1e9,
                       _ctx_default(source, ckpt), dev, dt)


def _check_vocab(tokenizer: Tokenizer, ckpt: checkpoint.Checkpoint) -> None:
    """A tokenizer with tokens past the embedding's rows (added without resizing it) is refused: a prompt
    holding one would fail the device step, and every request running in it."""
    rows = ckpt.tensors.shape("model.embed_tokens.weight")[0]
    if len(tokenizer) > rows:
        raise ModelLoadError(f"the tokenizer has {len(tokenizer)} tokens but the embedding only {rows} rows: "
                             "resize the model's embeddings to the tokenizer (transformers' resize_token_embeddings)")


def _gguf_tokenizer(source: ModelSource, converted: Path, step: Callable[[str], None],
                    gguf: gguf_file.GGUFFile) -> Tokenizer:
    """The GGUF's tokenizer: from its copy in the cache, made on the first load (``gguf``: the file,
    its header read, whose chat template a converted tokenizer without one takes)."""
    if (converted / _DONE).is_file():
        if missing := [name for name in _COPIED if not (converted / name).is_file()]:
            raise _CacheUnreadable(f"The cached copy '{converted}' lacks {' and '.join(missing)}")
        step("reading the tokenizer")
        _prune_converted(converted.parent, converted)  # at every start: a copy turns stale, or abandoned, later
        with _cached(converted / "tokenizer.json"):
            return Tokenizer.read(converted)
    step("converting the GGUF's tokenizer (first load only)")
    with _hush():
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        # AutoTokenizer reads the model's config too, which transformers maps only for the families it runs
        arch = gguf.fields.get("general.architecture")
        reader = PreTrainedTokenizerFast if arch in gguf_file.UNMAPPED else AutoTokenizer
        tokenizer = Tokenizer.of(_gguf_call(source, reader.from_pretrained))
    if not tokenizer.chat_template:  # the file's, else the turns of its architecture where mashbox knows them
        tokenizer.chat_template = gguf.fields.get("tokenizer.chat_template") or FALLBACKS.get(arch)
    tokenizer.tool_template = tokenizer.tool_template or gguf.fields.get("tokenizer.chat_template.tool_use")
    _save_tokenizer(tokenizer, converted, source.path)
    return tokenizer


@contextlib.contextmanager
def _cached(file: Path) -> Iterator[None]:
    """Errors while reading a file the cache holds become ``_CacheUnreadable``, naming it."""
    if not (file.is_file() and file.is_relative_to(cache_dir())):
        yield
        return
    try:
        yield
    except Exception as err:
        why = err.__cause__ or err
        raise _CacheUnreadable(f"The cached file '{file}' does not read ({type(why).__name__}: {why})") from err


def hf_model(model: str, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """``model`` as a transformers model on CPU, for references in benchmarks (transformers
    dequantizes a GGUF itself: slow)."""
    with _hush():
        return _load_model(resolve(model), dtype).eval()


def pick_device(device: str | torch.device | None) -> torch.device:
    """The given device, else ``cuda`` when torch sees a GPU, else ``cpu``."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"Device '{device}' was asked for but torch sees no CUDA GPU. "
                             "Leave the device unset or use 'cpu'.")
    return dev


@contextlib.contextmanager
def _hush() -> Iterator[None]:
    """Import transformers and silence its logging, Python warnings and stray tqdm bars while it
    runs; restore them afterwards."""
    with warnings.catch_warnings():  # tqdm.auto warns on import in a Jupyter kernel without ipywidgets
        warnings.filterwarnings("ignore", "IProgress not found")
        import transformers

    tlog = transformers.utils.logging
    verbosity, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        tlog.set_verbosity(verbosity)
        if bars:
            tlog.enable_progress_bar()


def _load_tokenizer(source: ModelSource) -> Tokenizer:
    """An HF directory's tokenizer: its ``tokenizer.json``, else the one transformers makes of what
    the directory has (a sentencepiece model, a vocabulary and merges)."""
    if (source.path / "tokenizer.json").is_file():
        try:
            return Tokenizer.read(source.path)
        except Exception as err:  # OSError, json's ValueError, tokenizers' own kinds
            raise ModelLoadError(
                f"Cannot read the tokenizer of the HF model directory '{source.path}' "
                f"({type(err).__name__}: {err}).") from err
    _refuse_unreadable_tokenizer(source.path)
    with _hush():
        from transformers import AutoTokenizer

        return Tokenizer.of(_hf_call(source, AutoTokenizer.from_pretrained, str(source.path)))


def _refuse_unreadable_tokenizer(path: Path) -> None:
    """A folder without tokenizer.json whose tokenizer transformers cannot make here, said as such (transformers'
    own error named tiktoken, or listed every library it might have used)."""
    if (path / "tokenizer.model").is_file() and not all(map(_installed, ("sentencepiece", "google.protobuf"))):
        raise ModelLoadError(f"'{path}' has its tokenizer as a sentencepiece tokenizer.model and no tokenizer.json: "
                             "install sentencepiece and protobuf (pip install sentencepiece protobuf) to convert it, "
                             "or save the tokenizer with a tokenizer.json (save_pretrained writes one)")
    if not any(any(path.glob(pattern)) for pattern in TOKENIZER_FILES):
        raise ModelLoadError(f"'{path}' has no tokenizer: no tokenizer.json, tokenizer.model, vocabulary or merges "
                             "file (save_pretrained of the tokenizer writes them)")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _refuse_unknown(path: Path) -> None:
    """An HF directory whose config names an architecture mashbox cannot run is refused before
    anything is read (transformers would load it, and mashbox would run it as a Llama)."""
    try:
        config = json.loads((path / "config.json").read_text())
        kind = config.get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # reading the model says what is wrong with its config
    if "text_config" in config and "vision_config" in config:  # Gemma 3 4B-27B's layout, a vision tower and all
        named = ", ".join(config.get("architectures") or [str(kind)])
        raise ModelLoadError(f"'{path}' holds a model of text and images ({named}); mashbox runs text models: "
                             "load its text-only weights (a GGUF of it, for example)")
    quantized = config.get("quantization_config")
    if quantized:  # fp8 with its scales, GPTQ, AWQ, bitsandbytes: read as floats, they were garbage or an ImportError
        method = quantized.get("quant_method") if isinstance(quantized, dict) else None
        by = f" by {method!r}" if method else ""
        raise ModelLoadError(f"'{path}' holds weights quantized{by} (config.json's quantization_config); mashbox "
                             "reads float weights (safetensors) or a GGUF: load the float model, or a GGUF of it")
    if kind is not None and checkpoint.TYPES.get(kind, kind) not in checkpoint.SUPPORTED:
        raise ModelLoadError(f"'{path}' holds a {kind!r} model (config.json's model_type); mashbox runs "
                             f"{', '.join(checkpoint.SUPPORTED)} models")


def _read_checkpoint(source: ModelSource, device: torch.device, dtype: torch.dtype) -> checkpoint.Checkpoint | None:
    try:
        return checkpoint.read(source.path, device, dtype)
    except Exception as err:  # json, a missing config field, safetensors' own SafetensorError
        raise ModelLoadError(
            f"Cannot read the model in '{source.path}' ({type(err).__name__}: {err}). It needs "
            "config.json and the weights (*.safetensors), as save_pretrained writes them.") from err


def _load_model(source: ModelSource, dtype: torch.dtype) -> transformers.PreTrainedModel:
    from transformers import AutoModelForCausalLM

    if source.kind == "hf":
        return _hf_call(source, AutoModelForCausalLM.from_pretrained, str(source.path), dtype=dtype)
    return _gguf_call(source, AutoModelForCausalLM.from_pretrained, dtype=dtype)


def _gguf_call(source: ModelSource, fn: Callable, **kwargs):
    path = source.path
    try:
        return fn(str(path.parent), gguf_file=path.name, local_files_only=True, **kwargs)
    except Exception as err:  # the gguf reader and transformers raise many kinds
        raise ModelLoadError(corrupt_message(path, f"{type(err).__name__}: {err}",
                                             source.install)) from err


def _hf_call(source: ModelSource, fn: Callable, *args, **kwargs):
    try:
        return fn(*args, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(
            f"Cannot load the HF model directory '{source.path}' ({type(err).__name__}: {err}). It "
            "needs config.json, the weights (*.safetensors) and the tokenizer files, as "
            "save_pretrained writes them.") from err


def converted_dir(source: ModelSource) -> Path | None:
    """Where the tokenizer copy of a GGUF source lives in the cache; None for HF sources."""
    if source.kind != "gguf":
        return None
    key = json.dumps(_made_from(source.path)).encode()
    return cache_dir() / "converted" / f"{readable(source.path.stem)}-{hashlib.sha256(key).hexdigest()[:12]}-tokenizer"


def _made_from(gguf: Path) -> dict:
    return {"path": str(gguf), "stamp": stamp(gguf)}


def _stale(copy: Path) -> bool:
    """A complete converted copy whose GGUF is gone or changed, that does not say which it is, or that
    an older mashbox made (it holds the whole model dequantized)."""
    if (copy / "model.safetensors").exists():
        return True
    try:
        made_from = json.loads((copy / _SOURCE).read_text())
        return _made_from(Path(made_from["path"])) != made_from
    except (OSError, ValueError, KeyError, TypeError):
        return True


def _prune_converted(folder: Path, keep: Path) -> None:
    """Remove the complete copies in ``folder`` but ``keep`` that are stale, and the copies a save began
    long ago and never finished (a process killed mid-save; an older mashbox's were whole models)."""
    for copy_dir in folder.iterdir():
        if copy_dir == keep or not copy_dir.is_dir():
            continue
        if (copy_dir / _DONE).is_file() and _stale(copy_dir):  # else in use, or being written
            log.info("removing the converted copy '%s': its GGUF is gone or changed, or it is an old form", copy_dir)
            shutil.rmtree(copy_dir, ignore_errors=True)
        elif not (copy_dir / _DONE).exists() and _abandoned(copy_dir):
            log.info("removing '%s': a converted copy whose save was cut off", copy_dir)
            shutil.rmtree(copy_dir, ignore_errors=True)


def _abandoned(copy: Path) -> bool:
    """Whether nothing was written in ``copy`` for a day: no save takes that long."""
    try:
        newest = max([copy.stat().st_mtime, *(f.stat().st_mtime for f in copy.iterdir())])
    except OSError:  # removed meanwhile
        return False
    return time.time() - newest > ABANDONED_S


def _save_tokenizer(tokenizer: Tokenizer, dest: Path, gguf: Path) -> None:
    """Save the tokenizer read from ``gguf`` to ``dest`` (best effort: a failure only costs the next load
    the same seconds), then remove the stale copies beside it."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=dest.name + "."))
    except OSError:
        return
    try:
        tokenizer.save(tmp)
        (tmp / _SOURCE).write_text(json.dumps(_made_from(gguf)))
        (tmp / _DONE).write_text("ok\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        _prune_converted(dest.parent, dest)
    except Exception as err:  # tokenizers says a full disk as its own error, not OSError
        log.warning("the tokenizer copy could not be kept in %s (%s: %s); the next load converts it again",
                    dest.parent, type(err).__name__, err)
        shutil.rmtree(tmp, ignore_errors=True)


def _bpw(source: ModelSource, ckpt: checkpoint.Checkpoint) -> float:
    if source.bpw is not None:
        return source.bpw
    files = [source.path] if source.path.is_file() else [
        p for p in source.path.iterdir() if p.suffix in (".safetensors", ".bin")]
    return round(sum(p.stat().st_size for p in files) * 8 / max(ckpt.numel, 1), 2)


def _ctx_default(source: ModelSource, ckpt: checkpoint.Checkpoint) -> int:
    if source.ctx_default is not None:
        return source.ctx_default
    # LongRoPE turns every position by its long factors once ctx passes the original context: by default
    # stay within it, where short prompts get the short factors that transformers gives them
    return min(int(ckpt.original_ctx or ckpt.trained_ctx or CTX_CAP), CTX_CAP)
