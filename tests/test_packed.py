"""The kernels' packed matrices kept in a file: a later start maps them and packs nothing, answering
exactly as the start that packed them; a file that does not follow the model is packed again and
replaced; the files of weights that changed or went away are removed."""

import ctypes
import json
import logging
import mmap
import os
import time

import pytest
import torch
from quants import random_prompts, tiny_gguf
from test_quant import MODELS
from tiny import greedy

from mashbox import Engine
from mashbox.engine.load.gguf_file import checkpoint, open_model
from mashbox.engine.model import packed, quant
from mashbox.engine.model.packed import Packer
from mashbox.engine.model.runner import ModelRunner


def runner(path, lib, packer):
    ckpt = checkpoint(open_model(path), torch.device("cpu"), torch.float32, lib)
    return ModelRunner(ckpt, num_slots=4, ctx=512, form="gguf", packer=packer)


def matrices(r):
    return [p for lin in r.weights.linears for p in lin.parts]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("packed") / "tiny.gguf", MODELS["qwen2"](), "qwen2",
                     ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])


def test_a_second_start_maps_what_the_first_packed(tmp_path, lib, gguf, monkeypatch):
    first = runner(gguf, lib, Packer.kept(lib, tmp_path, gguf, "gguf"))
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("tiny-") and files[0].suffix == ".mbpack"

    monkeypatch.setattr(quant, "pack", lambda b, _: b if b.packed else pytest.fail("packed again"))
    packer = Packer.kept(lib, tmp_path, gguf, "gguf")
    second = runner(gguf, lib, packer)
    start, end = packer._data.data_ptr(), packer._data.data_ptr() + packer._data.numel()
    assert matrices(second) and all(start <= p.data.data_ptr() < end for p in matrices(second))  # views of the file
    for a, b in zip(matrices(first), matrices(second), strict=True):
        assert (a.fmt, a.rows, a.k) == (b.fmt, b.rows, b.k) and torch.equal(a.data, b.data)
    prompts = random_prompts((1, 7, 60, 200))
    assert greedy(second, prompts) == greedy(first, prompts)
    assert list(tmp_path.iterdir()) == files  # nothing written again


def test_weights_rewritten_with_the_same_size_and_time_get_a_file_of_their_own(tmp_path, lib, gguf):
    """Other weights copied over a GGUF with its size and time kept (``cp -p``, ``touch -r``, a re-quantized
    file of the same shape) mapped the old file's packed matrices: the old model answered, unsaid."""
    weights = tmp_path / "model.gguf"
    weights.write_bytes(gguf.read_bytes())
    before = Packer.kept(lib, tmp_path / "packed", weights, "gguf").path
    times = weights.stat()
    changed = bytearray(gguf.read_bytes())
    changed[-64:] = bytes(64)
    weights.write_bytes(bytes(changed))
    os.utime(weights, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert weights.stat().st_size == times.st_size and weights.stat().st_mtime_ns == times.st_mtime_ns
    assert Packer.kept(lib, tmp_path / "packed", weights, "gguf").path != before


def vm_flags(address: int) -> list[str]:
    """The kernel's flags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


def huge_pages_allowed() -> bool:
    """Whether the kernel has transparent huge pages and lets this process ask for them."""
    with open("/proc/self/status") as status:
        allowed = "THP_enabled:\t0" not in status.read()
    return allowed and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def test_the_mapped_file_asks_for_huge_pages(tmp_path, lib, gguf):
    """Read anew (after a reboot, or once the page cache let it go), the file comes in 2 MB pages where the
    kernel has transparent huge pages: a decode step reading the weights then misses the TLB less."""
    runner(gguf, lib, Packer.kept(lib, tmp_path, gguf, "gguf"))
    packer = Packer.kept(lib, tmp_path, gguf, "gguf")
    flags = vm_flags(packer._data.data_ptr())
    assert "rd" in flags  # the file's mapping was found
    assert ("hg" in flags) == huge_pages_allowed()


def test_matrices_packed_in_memory_ask_for_huge_pages(lib, gguf):
    """The start that packs runs from its own copies: fresh memory asked for in 2 MB pages (transparent
    huge pages are often given only when asked), as the mapped file is."""
    first = runner(gguf, lib, Packer(lib))
    for p in matrices(first):
        flags = vm_flags(p.data.data_ptr())
        assert flags and ("hg" in flags) == huge_pages_allowed()


def test_the_saved_file_leaves_the_page_cache_to_be_read_anew(tmp_path, lib, gguf):
    """Written a matrix at a time, the file's cached pages would be mostly of 4 KB, and a later start's
    mapping would use them as they are: once saved the file is on the disk and none of it cached, so that
    the next start's mapping reads it anew (in 2 MB pages where the kernel has them)."""
    runner(gguf, lib, Packer.kept(lib, tmp_path, gguf, "gguf"))
    (path,) = tmp_path.glob("*.mbpack")
    assert os.path.getsize(path) > 100_000 and cached_pages(path) == 0
    path.read_bytes()
    assert cached_pages(path) > 0  # the count sees pages that are cached


@pytest.mark.parametrize("damage", ["truncated", "another order", "empty"])
def test_a_file_that_does_not_follow_the_model_is_packed_again_and_replaced(tmp_path, lib, gguf, caplog, damage):
    first = runner(gguf, lib, Packer.kept(lib, tmp_path, gguf, "gguf"))
    [path] = tmp_path.iterdir()
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # the index's first matrix said to have other rows
        at, _ = packed.TAIL.unpack(data[-packed.TAIL.size :])
        index = json.loads(data[at : -packed.TAIL.size])
        index["matrices"][0][1] += 1
        path.write_bytes(data[:at] + json.dumps(index).encode() + data[-packed.TAIL.size :])
    caplog.set_level(logging.INFO, "mashbox.engine")
    packer = Packer.kept(lib, tmp_path, gguf, "gguf")
    second = runner(gguf, lib, packer)
    assert packer._new and "packed weights saved" in caplog.text
    prompts = random_prompts((3, 90))
    assert greedy(second, prompts) == greedy(first, prompts)
    assert path.read_bytes() == data  # made again, whole
    again = Packer.kept(lib, tmp_path, gguf, "gguf")
    runner(gguf, lib, again)
    assert not again._new


def test_files_of_changed_or_missing_weights_and_half_written_ones_are_removed(tmp_path, lib, gguf):
    folder = tmp_path / "packed"
    other = tiny_gguf(tmp_path / "other.gguf", MODELS["llama"](), "llama", ["Q4_K"])
    runner(other, lib, Packer.kept(lib, folder, other, "gguf"))
    kept_other = next(folder.iterdir())
    runner(gguf, lib, Packer.kept(lib, folder, gguf, "gguf"))
    before = Packer.kept(lib, folder, gguf, "gguf").path
    old_tmp, new_tmp = folder / "tiny-x.tmp", folder / "tiny-y.tmp"
    old_tmp.write_bytes(b"half"), new_tmp.write_bytes(b"half")
    os.utime(old_tmp, (time.time() - 3600,) * 2)

    os.utime(gguf, (time.time() + 5,) * 2)  # the weights changed: a new name, the old file goes
    after = Packer.kept(lib, folder, gguf, "gguf")
    assert after.path != before
    runner(gguf, lib, after)
    assert sorted(folder.iterdir()) == sorted([after.path, kept_other, new_tmp])

    other.unlink()  # weights gone: their packed file goes at the next save
    os.utime(gguf, (time.time() + 10,) * 2)
    last = Packer.kept(lib, folder, gguf, "gguf")
    runner(gguf, lib, last)
    assert sorted(folder.iterdir()) == sorted([last.path, new_tmp])


def test_a_half_written_file_goes_at_the_next_start_with_nothing_to_save(tmp_path, lib, gguf):
    """A start killed while writing left a model-size temporary file; the starts after it map the saved file
    and save nothing, which is when half-written files were removed."""
    folder = tmp_path / "packed"
    runner(gguf, lib, Packer.kept(lib, folder, gguf, "gguf"))
    left, writing = folder / "tiny-z.tmp", folder / "tiny-w.tmp"
    left.write_bytes(b"half"), writing.write_bytes(b"half")
    os.utime(left, (time.time() - 3600,) * 2)
    again = Packer.kept(lib, folder, gguf, "gguf")
    runner(gguf, lib, again)
    assert not again._new and not left.exists() and writing.exists()


def test_two_forms_of_one_gguf_keep_a_file_each(tmp_path, lib, gguf):
    """A notebook's int8 Engine and a server's default form of the same GGUF removed each other's file, so
    every start packed again."""
    folder = tmp_path / "packed"
    for mode in ("gguf", "q8"):
        runner(gguf, lib, Packer.kept(lib, folder, gguf, mode))
    assert len(list(folder.glob("*.mbpack"))) == 2
    again = Packer.kept(lib, folder, gguf, "gguf")
    runner(gguf, lib, again)
    assert not again._new


def test_a_folder_that_cannot_be_written_leaves_the_model_running_from_memory(tmp_path, lib, gguf, caplog):
    (tmp_path / "file").write_bytes(b"")
    caplog.set_level(logging.WARNING, "mashbox.engine")
    r = runner(gguf, lib, Packer.kept(lib, tmp_path / "file", gguf, "gguf"))
    assert "could not be saved" in caplog.text
    assert greedy(r, random_prompts((5,)))


def test_the_engine_keeps_its_packed_weights_in_the_cache_folder(tmp_path, monkeypatch, gguf):
    monkeypatch.setenv("MASHBOX_CACHE", str(tmp_path))
    answers = []
    for _ in range(2):
        with Engine(str(gguf), slots=2, ctx=256, quiet=True) as engine:
            answers.append(engine.complete(prompt="one two", max_tokens=8, temperature=0).choices[0].text)
        [path] = (tmp_path / "packed").iterdir()
        assert path.suffix == packed.SUFFIX
    assert answers[0] == answers[1] and answers[0]


def test_a_disk_nearly_full_gets_no_file(tmp_path, lib, gguf, caplog, monkeypatch):
    free = packed.ROOM + 100_000  # less than the packed model needs on top
    monkeypatch.setattr(packed.shutil, "disk_usage", lambda _: type("Usage", (), {"free": free})())
    caplog.set_level(logging.INFO, "mashbox.engine")
    r = runner(gguf, lib, Packer.kept(lib, tmp_path / "packed", gguf, "gguf"))
    assert "not saved" in caplog.text and not list((tmp_path / "packed").iterdir())
    assert greedy(r, random_prompts((5,)))


def cached_pages(path) -> int:
    """How many of the file's pages the page cache holds (mincore over a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        pages = -(-len(m) // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        view = ctypes.c_char.from_buffer(m)
        try:
            assert libc.mincore(ctypes.addressof(view), len(m), vector) == 0, os.strerror(ctypes.get_errno())
        finally:
            del view
        return sum(v & 1 for v in vector)
