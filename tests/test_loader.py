"""Catalog resolution, model loading and the split-GGUF assembly. No network, no hub."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mashbox.engine.load import catalog, loader
from mashbox.engine.load.catalog import PackageFile, SplitFile, assemble, assemble_split, resolve, stamp
from mashbox.engine.load.loader import LoadedModel, converted_dir, hf_model, load
from mashbox.engine.request import Message
from mashbox.engine.text.template import ChatTemplate
from mashbox.engine.text.tokenizer import Tokenizer
from mashbox.errors import ConfigError, ModelLoadError


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    """A private cache folder for this module (the GGUF's tokenizer copy lands there)."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("cache")
        mp.setenv("MASHBOX_CACHE", str(path))
        yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def smol(cache: Path) -> LoadedModel:
    return load("smollm2-135m")


def test_catalog_lists_both_models() -> None:
    entries = catalog.catalog()
    assert {"smollm2-135m", "qwen2.5-coder-0.5b"} <= set(entries)
    assert entries["smollm2-135m"].ctx == 8192
    assert entries["qwen2.5-coder-0.5b"].ctx == 32768


def test_embedded_model_loads(smol: LoadedModel) -> None:
    assert smol.id == "smollm2-135m"
    assert smol.checkpoint.model_type == "llama" and smol.checkpoint.spec.num_layers == 30
    # every matrix of the GGUF as its blocks, a view of the file: 7 Q4_1 a layer, the embedding Q8_0
    # (also the output: tied)
    blocks = smol.checkpoint.blocks
    assert len(blocks) == 30 * 7 + 2 and blocks["lm_head.weight"] is blocks["model.embed_tokens.weight"]
    q = blocks["model.layers.3.self_attn.q_proj.weight"]
    assert q.name == "Q4_1" and q.data.shape == (576, 576 // 32 * 20) and blocks["lm_head.weight"].name == "Q8_0"
    assert smol.weights.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert smol.device == torch.device("cpu") and smol.dtype == torch.float32
    assert smol.ctx_default == 8192
    assert 0.09 < smol.gb < 0.11 and 5 < smol.bpw < 6  # the file's size
    assert isinstance(smol.tokenizer, Tokenizer) and smol.tokenizer.eos_token_id == 2  # <|im_end|>


def test_a_gguf_loaded_by_its_path_counts_a_tied_output_once(smol: LoadedModel) -> None:
    """Bits per weight from the file's size (its metadata too: the catalog says 5.74), each weight once (the
    tied output was counted twice: 4.83)."""
    by_path = load(smol.weights)
    assert 5.74 < by_path.bpw < 5.9 and by_path.gb == pytest.approx(smol.gb, rel=0.01)


def test_gguf_tensors_are_the_weights_transformers_reads(smol: LoadedModel) -> None:
    """Names, llama's q/k row order and the dequantization, against transformers' own GGUF reader."""
    reference = hf_model("smollm2-135m").state_dict()
    for name in ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
                 *[f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 29) for p in "qkvo"],
                 *[f"model.layers.7.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]]:
        assert torch.equal(smol.checkpoint.tensors[name], reference[name]), name


def test_embedded_chat_template_is_chatml(smol: LoadedModel) -> None:
    text = ChatTemplate(smol.tokenizer).render((Message("user", "Hi"),))
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_second_load_reads_the_tokenizer_copy_and_the_same_weights(smol: LoadedModel) -> None:
    converted = converted_dir(resolve("smollm2-135m"))
    assert (converted / "complete").is_file() and (converted / "tokenizer.json").is_file()
    assert not (converted / "model.safetensors").exists()  # the weights are read from the GGUF itself
    assert json.loads((converted / "source.json").read_text())["path"] == smol.weights
    again = load("smollm2-135m")
    first, second = smol.checkpoint, again.checkpoint
    assert first.blocks.keys() == second.blocks.keys()
    assert all(torch.equal(b.data, second.blocks[name].data) for name, b in first.blocks.items())
    assert torch.equal(first.tensors["model.norm.weight"], second.tensors["model.norm.weight"])
    assert (first.spec, first.eos_ids, first.trained_ctx) == (second.spec, second.eos_ids, second.trained_ctx)
    assert torch.equal(first.cos_sin(64, torch.float32)[0], second.cos_sin(64, torch.float32)[0])
    text = "The capital of France is <|im_start|> naïve"
    assert again.tokenizer.encode(text) == smol.tokenizer.encode(text)
    assert again.tokenizer.chat_template == smol.tokenizer.chat_template
    assert again.tokenizer.eos_token_id == smol.tokenizer.eos_token_id


def test_corrupt_cached_copy_is_named_then_built_again(smol: LoadedModel, caplog) -> None:
    converted = converted_dir(resolve("smollm2-135m"))
    file = converted / "tokenizer.json"
    size = file.stat().st_size
    with file.open("r+b") as f:
        f.truncate(size // 2)  # a disk that filled up, a copy cut short
    with caplog.at_level("WARNING", logger="mashbox.engine"):
        again = load("smollm2-135m")
    assert f"The cached file '{file}' does not read" in caplog.text and "building it again" in caplog.text
    assert file.stat().st_size == size and (converted / "complete").is_file()
    text = "The capital of France is"
    assert again.tokenizer.encode(text) == smol.tokenizer.encode(text)


@pytest.mark.parametrize("lost", ["tokenizer.json", "tokenizer_config.json"])
def test_a_cached_copy_missing_a_file_is_named_then_built_again(smol: LoadedModel, caplog, lost) -> None:
    """Without tokenizer.json the model did not load at all; without tokenizer_config.json it loaded with no
    chat template, and every chat was refused."""
    converted = converted_dir(resolve("smollm2-135m"))
    (converted / lost).unlink()
    with caplog.at_level("WARNING", logger="mashbox.engine"):
        again = load("smollm2-135m")
    assert f"The cached copy '{converted}' lacks {lost}" in caplog.text and (converted / lost).is_file()
    assert again.tokenizer.chat_template == smol.tokenizer.chat_template
    assert again.tokenizer.encode("The capital of France") == smol.tokenizer.encode("The capital of France")


def test_a_tokenizer_copy_the_disk_cannot_take_is_said_and_leaves_nothing(tmp_path: Path, smol_tokenizer,
                                                                         monkeypatch, caplog) -> None:
    """tokenizers says a full disk as a plain Exception: the load failed, and each try left a folder."""
    def full(self, folder):
        (folder / "tokenizer.json").write_text("{")
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(Tokenizer, "save", full)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with caplog.at_level("WARNING", logger="mashbox.engine"):
        loader._save_tokenizer(Tokenizer.of(smol_tokenizer), tmp_path / "converted" / "m-tokenizer", gguf)
    assert list((tmp_path / "converted").iterdir()) == [] and "No space left on device" in caplog.text


def test_saving_a_tokenizer_copy_removes_the_stale_ones(tmp_path: Path, smol_tokenizer) -> None:
    """Copies whose GGUF is gone or changed go, and those made before copies named their GGUF, and
    those an older mashbox made with the whole model in them, and those whose save was cut off a day
    ago; copies of a GGUF still there, and copies being written, stay."""
    folder = tmp_path / "converted"
    kept, changed = tmp_path / "kept.gguf", tmp_path / "changed.gguf"
    kept.write_bytes(b"GGUF kept")
    changed.write_bytes(b"GGUF before")

    def copy(name: str, gguf: Path | None, *, complete: bool = True) -> Path:
        path = folder / name
        path.mkdir(parents=True)
        if gguf is not None:
            made_from = {"path": str(gguf), "stamp": stamp(gguf) if gguf.exists() else [0, 0, 0, 0]}
            (path / "source.json").write_text(json.dumps(made_from))
        if complete:
            (path / "complete").write_text("ok\n")
        return path

    gone, old = copy("gone", tmp_path / "deleted.gguf"), copy("old", None)
    stays, writing, now_changed = copy("stays", kept), copy("writing.x1", None, complete=False), copy("c", changed)
    whole = copy("whole-float32", kept)
    (whole / "model.safetensors").write_bytes(b"an older mashbox's dequantized model")
    cut = copy("cut.k7x2q9ab", None, complete=False)
    (cut / "model.safetensors").write_bytes(b"half of an older mashbox's model, its save killed")
    for path in (cut, cut / "model.safetensors"):
        os.utime(path, (time.time() - 2 * 86400,) * 2)
    changed.write_bytes(b"GGUF after, longer")
    new = folder / "new"
    loader._save_tokenizer(Tokenizer.of(smol_tokenizer), new, kept)
    assert (new / "complete").is_file() and json.loads((new / "source.json").read_text())["path"] == str(kept)
    assert (new / "tokenizer.json").is_file()
    assert {p.name for p in folder.iterdir()} == {"new", "stays", "writing.x1"}
    assert not any(p.exists() for p in (gone, old, now_changed, whole, cut)) and stays.exists() and writing.exists()


def test_hf_directory_loads(smol: LoadedModel, tmp_path: Path) -> None:
    config = LlamaConfig(vocab_size=len(smol.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16384)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    smol.tokenizer.save(tmp_path)
    tiny = load(str(tmp_path))
    assert tiny.id == tmp_path.name
    assert tiny.checkpoint.spec.num_layers == 2 and tiny.checkpoint.spec.num_kv_heads == 2
    assert tiny.ctx_default == 8192  # capped
    assert "<|im_start|>" in ChatTemplate(tiny.tokenizer).render((Message("user", "Hi"),))


@pytest.mark.parametrize(("make", "words"), [
    (lambda tmp: "no-such-model", ["Unknown model", "smollm2-135m", "qwen2.5-coder-0.5b", "path"]),
    (lambda tmp: str(tmp / "missing.gguf"), ["does not exist", ".gguf", "config.json"]),
    (lambda tmp: str(tmp), ["without config.json", "save_pretrained"]),
])
def test_bad_argument_says_what_to_do(tmp_path: Path, make, words: list[str]) -> None:
    with pytest.raises(ModelLoadError) as err:
        load(make(tmp_path))
    for word in words:
        assert word in str(err.value)


def test_an_hf_directory_of_an_architecture_mashbox_cannot_run_is_refused_before_loading(tiny_model_dir: Path,
                                                                                          tmp_path: Path) -> None:
    """A Mamba directory (its config, its weights) is refused by name before its tokenizer or
    weights are read, not loaded through transformers and run as a Llama."""
    folder = tmp_path / "mamba"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    (folder / "tokenizer.json").write_text("not read")  # reading it would fail otherwise
    with pytest.raises(ModelLoadError) as err:
        load(str(folder))
    assert str(err.value) == (f"'{folder}' holds a 'mamba' model (config.json's model_type); mashbox runs "
                              "llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, smollm3, granite models")


@pytest.mark.parametrize("head", [b"", b"GGUF\x03\x00\x00\x00"])
def test_corrupt_gguf_is_named(cache: Path, tmp_path: Path, head: bytes) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(head + os.urandom(4096))
    with pytest.raises(ModelLoadError) as err:
        load(str(bad))
    assert "broken.gguf" in str(err.value) and "corrupt" in str(err.value)


def _damaged(smol: LoadedModel, tmp_path: Path, change) -> Path:
    """A copy of the embedded GGUF with ``change(data)`` made to its bytes."""
    data = bytearray(Path(smol.weights).read_bytes())
    change(data)
    (path := tmp_path / "damaged.gguf").write_bytes(data)
    return path


def _u32_field(key: str, value: int):
    """Set the GGUF metadata field ``key`` (a uint32) to ``value``."""
    def change(data: bytearray) -> None:
        at = data.index(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key)
        assert struct.unpack_from("<I", data, at)[0] == 4  # a uint32
        struct.pack_into("<I", data, at + 4, value)
    return change


def _tensor_type(name: str, kind: int):
    """Give the tensor ``name`` another type in the file's list (its bytes left as they are)."""
    def change(data: bytearray) -> None:
        at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
        dims = struct.unpack_from("<I", data, at)[0]
        struct.pack_into("<I", data, at + 4 + 8 * dims, kind)
    return change


def _renamed_tensor(name: str):
    """Rename the tensor ``name`` (its last letter changed): the file no longer has it."""
    def change(data: bytearray) -> None:
        at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name) - 1
        data[at] = ord("x")
    return change


def _renamed_field(key: str):
    """Rename the metadata ``key`` (one letter changed): the file no longer has it."""
    def change(data: bytearray) -> None:
        at = data.index(struct.pack("<Q", len(key)) + key.encode()) + 8
        data[at] = ord("x")
    return change


@pytest.mark.parametrize(("change", "said"), [
    (_renamed_field("llama.attention.head_count"), "lacks the metadata llama.attention.head_count"),  # a TypeError
    (_u32_field("llama.attention.head_count_kv", 1), "tensor blk.0.attn_k.weight is 192 x 576, where its head "
                                                     "counts and sizes make it 64 x 576"),
    (_u32_field("llama.attention.head_count_kv", 4), "tensor blk.0.attn_k.weight is 192 x 576"),
    (_u32_field("llama.block_count", 29), "it has tensor blk.29."),
    (_u32_field("llama.block_count", 31), "it has no attention for layer 30 of the 31 its block_count says"),
    (_tensor_type("blk.5.attn_q.weight", 8), "tensor blk.5.attn_q.weight runs into"),  # Q4_1 -> Q8_0
    (_renamed_tensor("blk.1.ffn_down.weight"), "it has no tensor blk.1.ffn_down.weight (layer 1 of 30)"),  # KeyErrors
    (_renamed_tensor("output_norm.weight"), "it has no tensor output_norm.weight"),
    (_renamed_tensor("blk.0.ffn_norm.weight"), "it has no tensor blk.0.ffn_norm.weight"),  # a SIGSEGV at a step
    (_renamed_tensor("blk.2.attn_k.weight"), "it has no tensor blk.2.attn_k.weight"),
    (_renamed_tensor("blk.3.ffn_gate.weight"), "it has no tensor blk.3.ffn_gate.weight"),
])
def test_a_gguf_whose_metadata_does_not_follow_its_tensors_is_refused(smol: LoadedModel, tmp_path: Path, change,
                                                                      said: str) -> None:
    """One number changed: a wrong head count made the kernels write past their buffers (a crash at the
    first request), others answered nonsense or raised a KeyError; llama.cpp refuses them all at load."""
    path = _damaged(smol, tmp_path, change)
    with pytest.raises(ModelLoadError, match=re.escape(said)) as err:
        load(str(path))
    assert "damaged.gguf" in str(err.value)


def test_one_part_of_a_split_gguf_says_how_to_merge_it(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "model-00001-of-00003.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint16("split.no", 0)
    writer.add_uint16("split.count", 3)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"part 1 of a model split in 3 files .*llama-gguf-split --merge"):
        load(str(path))


def test_split_model_not_installed_gives_pip_command(tmp_path: Path) -> None:
    if all(catalog.package_file(p) for p in catalog.catalog()["qwen2.5-coder-0.5b"].source.parts):
        pytest.skip("qwen parts are installed here")
    with pytest.raises(ModelLoadError) as err:
        resolve("qwen2.5-coder-0.5b", cache=tmp_path)
    assert "not installed" in str(err.value) and "pip install" in str(err.value)
    assert "mashbox[qwen]" in str(err.value)


def _fake_parts(root: Path, chunks: list[bytes]) -> tuple[PackageFile, ...]:
    """Packages fake_part1..N on sys.path, each holding data/partNN.bin."""
    refs = []
    for n, chunk in enumerate(chunks, 1):
        pkg = root / f"fake_part{n}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        (pkg / "data" / f"part{n:02d}.bin").write_bytes(chunk)
        refs.append(PackageFile(f"fake_part{n}", f"data/part{n:02d}.bin"))
    return tuple(refs)


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[PackageFile, ...], bytes]:
    chunks = [b"GGUF" + os.urandom(1000), os.urandom(777), os.urandom(5)]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return _fake_parts(tmp_path / "site", chunks), b"".join(chunks)


def test_split_assembles_once(parts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refs, whole = parts
    split = SplitFile(refs, "joined.gguf", len(whole), hashlib.sha256(whole).hexdigest())
    first = assemble_split(split, tmp_path / "cache")
    assert first is not None and first.read_bytes() == whole
    stamp = first.stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("joined again")

    monkeypatch.setattr(catalog, "assemble", boom)
    assert assemble_split(split, tmp_path / "cache") == first
    assert first.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in first.parent.iterdir()) == ["joined.gguf", "joined.gguf.verified"]


def test_split_hash_mismatch_leaves_nothing(parts, tmp_path: Path) -> None:
    refs, whole = parts
    split = SplitFile(refs, "joined.gguf", len(whole), "0" * 64)
    with pytest.raises(ModelLoadError) as err:
        assemble_split(split, tmp_path / "cache", install="pip install 'mashbox[qwen]'")
    assert "sha256" in str(err.value) and "mashbox[qwen]" in str(err.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_split_missing_part_is_not_installed(parts, tmp_path: Path) -> None:
    refs, whole = parts
    split = SplitFile(refs + (PackageFile("fake_absent_part", "data/x.bin"),), "joined.gguf",
                      len(whole), hashlib.sha256(whole).hexdigest())
    assert assemble_split(split, tmp_path / "cache") is None


def test_assemble_wrong_size(tmp_path: Path) -> None:
    part = tmp_path / "p.bin"
    part.write_bytes(b"abc")
    with pytest.raises(ModelLoadError, match="size 3 vs 4"):
        assemble([part], tmp_path / "out" / "x.gguf", size=4,
                 sha256=hashlib.sha256(b"abc").hexdigest())
    assert list((tmp_path / "out").iterdir()) == []


def test_a_join_a_killed_process_left_goes_and_one_under_way_stays(parts, tmp_path: Path) -> None:
    """Ctrl-C or the OOM killer mid-join left its temp file (up to the model's size) for good."""
    refs, whole = parts
    split = SplitFile(refs, "joined.gguf", len(whole), hashlib.sha256(whole).hexdigest())
    cache = tmp_path / "cache"
    cache.mkdir()
    left, joining = cache / "joined.gguf.3ypby5ih.tmp", cache / "joined.gguf.k2m9x0aa.tmp"
    left.write_bytes(b"x" * 1000), joining.write_bytes(b"x" * 10)
    os.utime(left, (time.time() - 3600,) * 2)
    assert assemble_split(split, cache) is not None
    assert sorted(p.name for p in cache.iterdir()) == sorted(["joined.gguf", "joined.gguf.verified", joining.name])
    os.utime(joining, (time.time() - 3600,) * 2)  # Ctrl-C, then a start that joined: the file is there already
    assert assemble_split(split, cache) is not None and not joining.exists()


def test_a_part_that_cannot_be_read_is_named_not_the_cache(tmp_path: Path) -> None:
    part = tmp_path / "gone.bin"
    with pytest.raises(ModelLoadError, match=r"Cannot read the model's part '.*gone\.bin'.*Reinstall the parts: pip x"):
        assemble([part], tmp_path / "out" / "x.gguf", size=3, sha256="0" * 64, install="pip x")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_join_that_cannot_be_written_says_where_and_what_to_do(parts, tmp_path: Path) -> None:
    refs, whole = parts
    split = SplitFile(refs, "joined.gguf", len(whole), hashlib.sha256(whole).hexdigest())
    in_the_way = tmp_path / "cache"
    in_the_way.write_text("a file where the cache's folder goes")
    with pytest.raises(ModelLoadError, match=r"Cannot write the model file .*joined\.gguf.* set MASHBOX_CACHE"):
        assemble_split(split, in_the_way)


def test_no_home_folder_for_the_cache_is_a_config_error_naming_mashbox_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HOME and a user the passwd file does not know (``docker --user 12345``): Python's RuntimeError was a
    traceback from every command."""
    def homeless() -> Path:
        raise RuntimeError("Could not determine home directory.")

    for name in ("MASHBOX_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(Path, "home", homeless)
    with pytest.raises(ConfigError, match="Could not determine home directory. Set MASHBOX_CACHE"):
        catalog.cache_dir()


def test_a_model_file_named_in_bytes_that_are_not_utf8_gets_an_id_every_answer_can_carry(tmp_path: Path) -> None:
    """``caf\\xe9.gguf`` (Latin-1): its id held a lone surrogate, and every HTTP answer naming the model was a
    500; the tokenizer's copy was never kept."""
    path = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9.gguf"))
    path.write_bytes(b"GGUF" + bytes(60))
    source = resolve(str(path))
    assert source.id == "caf\ufffd" and json.dumps(source.id, ensure_ascii=False).encode()
    loader.converted_dir(source).name.encode()  # no lone surrogate: tokenizers (Rust) saves there


def test_a_converted_copy_cut_off_goes_at_a_later_start_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pruned only where a tokenizer copy was saved: once the model's own copy was there, never again."""
    monkeypatch.setenv("MASHBOX_CACHE", str(tmp_path))
    loader.load("smollm2-135m")  # its tokenizer's copy saved
    cut = tmp_path / "converted" / "other-tokenizer.k7x2q9ab"
    cut.mkdir()
    os.utime(cut, (time.time() - 2 * 86400,) * 2)
    loader.load("smollm2-135m")
    assert not cut.exists()


def test_a_model_path_that_is_a_pipe_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelLoadError, match="not a regular file"):
        resolve(str(fifo))


def _saved_llama(folder: Path, smol_tokenizer, **config) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{
        "vocab_size": len(smol_tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "initializer_range": 0.3, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return model


@pytest.mark.parametrize(("config", "said"), [
    ({"attention_bias": True}, "self_attn.o_proj.bias: mashbox adds no bias there"),
    ({"mlp_bias": True}, "mlp.gate_proj.bias: mashbox adds no bias there"),
])
def test_biases_mashbox_would_not_add_are_refused_at_load(tmp_path: Path, smol_tokenizer, config, said) -> None:
    """o_proj's and the MLP's biases were read and never added: answers 11-26% off transformers', unsaid."""
    from mashbox import Engine

    _saved_llama(tmp_path, smol_tokenizer, **config)
    with pytest.raises(ModelLoadError, match=said):
        Engine(str(tmp_path), quiet=True, slots=1, ctx=64)


def test_an_unknown_activation_and_a_tokenizer_past_the_embedding_are_refused_at_load(tmp_path: Path,
                                                                                     smol_tokenizer) -> None:
    """Each loaded, then failed every request (and every other request in its step) at the device."""
    from mashbox import Engine

    _saved_llama(tmp_path, smol_tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "bogus_act"}))
    with pytest.raises(ModelLoadError, match="the activation 'bogus_act' \\(hidden_act\\) is not one mashbox knows"):
        Engine(str(tmp_path), quiet=True, slots=1, ctx=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    grown = copy.deepcopy(smol_tokenizer)
    grown.add_tokens(["<foo>"])
    grown.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=f"the tokenizer has {len(grown)} tokens but the embedding only"):
        Engine(str(tmp_path), quiet=True, slots=1, ctx=64)


def test_mistrals_sliding_window_is_applied(tmp_path: Path, smol_tokenizer) -> None:
    """Mistral v0.1's window (4096) was ignored: past it every answer differed from transformers'."""
    from tiny import answers_as_transformers
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=len(smol_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=16,
        initializer_range=0.3)).eval()
    answers_as_transformers(tmp_path, model, smol_tokenizer, [" ".join(f"word{i}" for i in range(30))], n=8)


def test_a_model_of_text_and_images_is_refused_before_loading(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Gemma 3 4B-27B's layout was loaded whole through transformers, then failed with an AttributeError."""
    folder = tmp_path / "gemma3-mm"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        **config, "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"model_type": "gemma3_text"}, "vision_config": {"model_type": "siglip_vision_model"}}))
    with pytest.raises(ModelLoadError, match="holds a model of text and images \\(Gemma3ForConditionalGeneration\\)"):
        load(str(folder))


def test_a_rotary_scaling_mashbox_does_not_know_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "foo-rope"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    rope = {"rope_type": "foo", "factor": 2.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": rope, "rope_scaling": rope}))
    with pytest.raises(ModelLoadError, match="the rotary scaling 'foo' \\(rope_type\\) is not one mashbox knows"):
        load(str(folder))


def test_a_gguf_reached_by_a_link_is_served_under_the_links_name(tmp_path: Path) -> None:
    """The hub's cache (huggingface-cli download) names a snapshot's file by a link to a blob named by its
    hash: the model was served as that hash, and a request naming the file's model got 404."""
    blob = tmp_path / "blobs" / ("7d1a6bd0" * 8)
    blob.parent.mkdir()
    blob.write_bytes(b"GGUF" + bytes(60))  # resolves; never loads
    link = tmp_path / "snapshots" / "abc" / "SmolLM2-135M-Instruct-Q4_1.gguf"
    link.parent.mkdir(parents=True)
    link.symlink_to(blob)
    source = catalog.resolve(str(link))
    assert source.id == catalog.served_id(str(link)) == "SmolLM2-135M-Instruct-Q4_1" and source.path == blob
    assert catalog.served_id(str(tmp_path / "snapshots" / "abc" / "..")) == "snapshots"


def _edited(tiny_model_dir: Path, tmp_path: Path, name: str, **changes) -> Path:
    folder = tmp_path / name
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq"])
def test_a_folder_of_quantized_weights_is_refused_by_its_method(tiny_model_dir: Path, tmp_path: Path,
                                                                 method: str) -> None:
    """fp8 weights were read as floats without their scales (garbage answers, no word); GPTQ and AWQ folders
    were transformers' ImportError advising a package that would not have made them run."""
    folder = _edited(tiny_model_dir, tmp_path, method, quantization_config={"quant_method": method})
    with pytest.raises(ModelLoadError, match=f"holds weights quantized by '{method}' \\(config.json's "
                                             "quantization_config\\); mashbox reads float weights"):
        load(str(folder))


def test_a_tensor_the_config_needs_and_the_weights_lack_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A config of one layer more than the weights have was a bare KeyError."""
    from mashbox import Engine

    folder = _edited(tiny_model_dir, tmp_path, "more-layers", num_hidden_layers=3)
    with pytest.raises(ModelLoadError, match="the weights have no tensor 'model.layers.2.self_attn.q_proj.weight'"):
        Engine(str(folder), ctx=256, slots=1, quiet=True)


def test_a_folders_end_of_text_comes_from_its_config_where_it_has_no_generation_config(tiny_model_dir: Path,
                                                                                      tmp_path: Path) -> None:
    """transformers falls back to config.json's eos_token_id; a safetensors folder without generation_config.json
    had none here, and answered on past it (a .bin folder, read through transformers, stopped)."""
    folder = _edited(tiny_model_dir, tmp_path, "eos", eos_token_id=[2, 77])
    (folder / "generation_config.json").unlink(missing_ok=True)
    assert load(str(folder)).checkpoint.eos_ids == (2, 77)


def test_a_folder_without_a_tokenizer_says_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    """transformers' own error listed every library that might have read one (sentencepiece, tiktoken)."""
    folder = _edited(tiny_model_dir, tmp_path, "no-tokenizer")
    for path in list(folder.glob("tokenizer*")) + list(folder.glob("vocab*")) + list(folder.glob("merges*")) + [
            folder / "special_tokens_map.json"]:
        path.unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match="has no tokenizer: no tokenizer.json, tokenizer.model, vocabulary"):
        load(str(folder))


def test_a_sentencepiece_tokenizer_without_its_libraries_names_them(tiny_model_dir: Path, tmp_path: Path,
                                                                    monkeypatch) -> None:
    """A tokenizer.model alone needs sentencepiece and protobuf for transformers to convert it; without them its
    error named tiktoken."""
    folder = _edited(tiny_model_dir, tmp_path, "spm")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(b"\x0a\x00")
    monkeypatch.setattr(loader, "_installed", lambda module: module != "google.protobuf")
    with pytest.raises(ModelLoadError, match="install sentencepiece and protobuf"):
        load(str(folder))
