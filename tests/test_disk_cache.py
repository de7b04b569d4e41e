"""The prefix cache's disk tier: prompt pages kept across engines (restarts), per tenant, bounded,
and safe against files that do not read."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mashbox import Engine, EngineRequest, SamplingParams, Started, TextDelta
from mashbox.engine.model import native
from mashbox.engine.model.kv_cache import KVCache
from mashbox.engine.sched.disk_cache import PageStore
from mashbox.server.health import cache_namespace

PROMPT = " ".join(f"item {i}," for i in range(90))  # ~440 tokens: one whole page of 256


def page(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, n, 3, 8), torch.randn(2, n, 3, 8)


def kept(folder: Path, prompt: list[int]) -> list[str]:
    """The keys of ``prompt``'s whole pages of 4, each saved in ``folder`` (random KV) by a store now closed."""
    store = PageStore(folder, 2**20, "ns", page=4)
    keys = store.keys(prompt, "")
    for i, key in enumerate(keys):
        store.save(key, prompt[4 * i: 4 * i + 4], *page())
    store.close()
    return keys


def test_pages_are_chained_by_every_token_before_them_and_by_tenant(tmp_path: Path):
    store = PageStore(tmp_path, 2**20, "ns", page=4)
    keys = store.keys(list(range(10)), "alice")
    assert len(keys) == 2  # two whole pages of 4; the last 2 tokens are no page
    assert store.keys(list(range(8)) + [99, 98], "alice") == keys  # the same 8 tokens, the same pages
    assert store.keys([0, 1, 2, 3, 9, 5, 6, 7], "alice")[1] != keys[1]  # a page depends on what came before
    assert store.keys(list(range(10)), "bob")[0] != keys[0]
    assert PageStore(tmp_path, 2**20, "other model", page=4).keys(list(range(10)), "alice")[0] != keys[0]
    store.close()


def test_a_page_is_written_in_the_background_and_read_back_exactly(tmp_path: Path):
    store = PageStore(tmp_path, 2**20, "ns", page=4)
    prompt = list(range(10))
    keys = store.keys(prompt, "")
    first, second = page(), page()
    store.save(keys[0], prompt[:4], *first)
    store.save(keys[1], prompt[4:8], *second)
    store.close()
    again = PageStore(tmp_path, 2**20, "ns", page=4)  # a restart: the index is the folder
    assert again.stored(keys) == 2
    k, v = again.read(keys, prompt)
    assert torch.equal(k, torch.cat([first[0], second[0]], dim=1)) and torch.equal(v, torch.cat([first[1], second[1]], 1))
    assert again.read(keys, [7] + prompt[1:]) is None  # tokens that are not the page's are refused


@pytest.mark.parametrize("gone", ["before it opens", "after it read"])
def test_a_page_another_process_trims_as_it_is_read_is_no_error(tmp_path: Path, caplog, monkeypatch, gone):
    """Removed (and written again) by another process between the index and the read: a quiet miss,
    the new file left alone; removed just after it was read: the page it read is kept."""
    store = PageStore(tmp_path, 2**20, "ns", page=4)
    prompt = list(range(4))
    keys = store.keys(prompt, "")
    first = page()
    store.save(keys[0], prompt, *first)
    store.close()
    again = PageStore(tmp_path, 2**20, "ns", page=4)
    assert again.stored(keys) == 1
    import mashbox.engine.sched.disk_cache as disk_cache

    def missing(*args, **kwargs):
        raise FileNotFoundError("removed by another process")

    monkeypatch.setattr(disk_cache.os, "utime", missing)
    if gone == "before it opens":
        import safetensors

        monkeypatch.setattr(safetensors, "safe_open", missing)
    with caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        got = again.read(keys, prompt)
    assert caplog.records == [] and (tmp_path / f"{keys[0]}.safetensors").is_file()
    assert (got is None) if gone == "before it opens" else torch.equal(got[0], first[0])


@pytest.mark.parametrize("damage", [b"", b"not a safetensors file at all", None])
def test_a_page_that_does_not_read_is_skipped_with_a_log_line_and_removed(tmp_path: Path, caplog, damage):
    prompt = list(range(8))
    keys = kept(tmp_path, prompt)
    second = tmp_path / f"{keys[1]}.safetensors"
    if damage is None:  # a foreign file under a page's name
        second.write_bytes((tmp_path / f"{keys[0]}.safetensors").read_bytes())
    else:
        second.write_bytes(damage)
    again = PageStore(tmp_path, 2**20, "ns", page=4)
    with caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        k, _ = again.read(keys, prompt)
    assert k.shape[1] == 4  # the first page still serves
    assert f"skipped the cached prompt page {second}" in caplog.text and not second.exists()
    assert again.stored(keys) == 1


def test_a_page_whose_keys_and_values_changed_on_disk_is_skipped_and_removed(tmp_path: Path, caplog):
    """Bytes a disk lost or changed in a page's tensors (its header and tokens intact) were read back as KV:
    answers of garbage, with no word said and the page kept for the next prompt too."""
    prompt = list(range(8))
    keys = kept(tmp_path, prompt)
    second = tmp_path / f"{keys[1]}.safetensors"
    data = bytearray(second.read_bytes())
    header = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8: 8 + header])["values"]["data_offsets"]
    data[8 + header + start: 8 + header + end] = bytes(end - start)  # the values' bytes, zeroed
    second.write_bytes(bytes(data))
    again = PageStore(tmp_path, 2**20, "ns", page=4)
    with caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        k, _ = again.read(keys, prompt)
    assert k.shape[1] == 4 and "checksum differs" in caplog.text and not second.exists()


def test_a_folder_gone_read_only_fails_no_read_and_stops_no_writer(tmp_path: Path, caplog, monkeypatch):
    """A page read, or used from memory, is touched on disk; where the folder had gone read-only the touch
    raised: the read crashed the engine (a 500, the worker started again), and the writer thread died, no
    page kept again once the folder could be written. A page that cannot be written is said once."""
    import mashbox.engine.sched.disk_cache as disk_cache

    prompt = list(range(8))
    keys = kept(tmp_path, prompt)
    store = PageStore(tmp_path, 2**20, "ns", page=4)

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(disk_cache.os, "utime", read_only)
    monkeypatch.setattr(disk_cache.os, "replace", read_only)
    other = list(range(100, 112))
    with caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        assert store.read(keys, prompt)[0].shape[1] == 8
        store.touch(keys)  # the writer touches them: it died there
        for i, key in enumerate(store.keys(other, "")):  # then three pages not kept: said once
            store.save(key, other[4 * i: 4 * i + 4], *page())
        store.close()  # the writer ends once it has taken all of them
    assert caplog.text.count("could not keep prompt pages") == 1, caplog.text
    assert store.stored(store.keys(other, "")) == 0


def test_a_page_that_does_not_read_and_cannot_be_removed_is_a_miss_said_once(tmp_path: Path, caplog):
    """A directory in a page's place (or a folder gone read-only): the removal fails, and the page is a miss
    from then on; it once raised out of the engine's step, stopping it on every request with that prompt."""
    prompt = list(range(8))
    keys = kept(tmp_path, prompt)
    second = tmp_path / f"{keys[1]}.safetensors"
    second.unlink()
    second.mkdir()
    again = PageStore(tmp_path, 2**20, "ns", page=4)
    with caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        k, _ = again.read(keys, prompt)
        assert k.shape[1] == 4 and again.stored(keys) == 1 and again.read(keys, prompt)[0].shape[1] == 4
        again.save(keys[1], prompt[4:], *page())  # not written over what could not be removed
        again.close()
    assert caplog.text.count(f"skipped the cached prompt page {second}") == 1 and second.is_dir()


def test_a_page_the_disk_cannot_take_is_not_kept_and_the_writer_goes_on(tmp_path: Path, caplog, monkeypatch):
    """A full disk is safetensors' own error, not an OSError: it once ended the writer's thread, and every
    later page then waited in memory for it, without end."""
    import safetensors.torch

    real, failures = safetensors.torch.save_file, iter([True])

    def full(tensors, path, metadata=None):
        if next(failures, False):
            raise safetensors.SafetensorError("No space left on device (os error 28)")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    store = PageStore(tmp_path, 2**20, "ns", page=4)
    prompt = list(range(8))
    keys = store.keys(prompt, "")
    with caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        store.save(keys[0], prompt[:4], *page())
        store.save(keys[1], prompt[4:], *page())
        store.close()
    assert "No space left on device" in caplog.text and not store._writer.is_alive()  # it ended at close
    assert store.stored(keys) == 0 and (tmp_path / f"{keys[1]}.safetensors").is_file() and store._queued == 0
    assert list(tmp_path.glob(".*.tmp")) == []


def test_pages_wait_for_a_slow_disk_up_to_a_bound(tmp_path: Path, monkeypatch):
    import threading

    import safetensors.torch

    import mashbox.engine.sched.disk_cache as disk_cache

    real, go = safetensors.torch.save_file, threading.Event()
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: go.wait() and real(*a, **k))
    one = sum(t.nbytes for t in page())
    monkeypatch.setattr(disk_cache, "QUEUED_BYTES", 3 * one)
    store = PageStore(tmp_path, 2**20, "ns", page=4)
    prompt = list(range(40))
    keys = store.keys(prompt, "")
    for i, key in enumerate(keys):
        store.save(key, prompt[4 * i: 4 * i + 4], *page())
    assert store._queued <= 3 * one  # the first is being written, three wait; the rest are not kept
    go.set()
    store.close()
    assert 3 <= len(list(tmp_path.glob("*.safetensors"))) <= 4 and store._queued == 0


def test_an_empty_page_file_is_removed_at_start_and_written_again(tmp_path: Path):
    """Renamed but never flushed (a power cut): a page of 0 bytes read as 'claimed, not yet written' for
    good, so the prompt missed the cache on every start and the file stayed."""
    prompt = list(range(4))
    keys = kept(tmp_path, prompt)
    (tmp_path / f"{keys[0]}.safetensors").write_bytes(b"")
    again = PageStore(tmp_path, 2**20, "ns", page=4)
    assert again.stored(keys) == 0 and not (tmp_path / f"{keys[0]}.safetensors").exists()
    again.save(keys[0], prompt, *page())
    again.close()
    assert PageStore(tmp_path, 2**20, "ns", page=4).stored(keys) == 1


def test_the_folder_keeps_within_its_cap_least_recently_used_out_first(tmp_path: Path):
    probe = PageStore(tmp_path / "probe", 2**30, "ns", page=4)
    probe.save("probe", [0, 1, 2, 3], *page())
    probe.close()
    size = (tmp_path / "probe" / "probe.safetensors").stat().st_size
    store = PageStore(tmp_path / "pages", int(size * 2.5), "ns", page=4)
    prompts = [[i] * 4 for i in range(4)]
    for prompt in prompts:
        store.save(store.keys(prompt, "")[0], prompt, *page())
    store.close()
    kept = [PageStore(tmp_path / "pages", 2**30, "ns", page=4).stored(store.keys(p, "")) for p in prompts]
    assert kept == [0, 0, 1, 1]


def test_a_prompt_read_keeps_its_first_pages_longest(tmp_path: Path):
    """Pages read in order were touched in order, so a trim took a prompt's first page first, and the
    pages after it, kept, could never be used again."""
    kept(tmp_path / "probe", [0, 1, 2, 3])
    size = next((tmp_path / "probe").glob("*.safetensors")).stat().st_size
    prompt = list(range(12))
    keys = kept(tmp_path / "pages", prompt)
    store = PageStore(tmp_path / "pages", int(size * 3.5), "ns", page=4)
    assert store.read(keys, prompt)[0].shape[1] == 12
    store.save(store.keys([99] * 4, "")[0], [99] * 4, *page())  # a fourth page: one must go
    store.close()
    assert PageStore(tmp_path / "pages", 2**30, "ns", page=4).stored(keys) == 2  # the first two: still of use


def test_pages_of_a_prompt_used_from_memory_outlive_pages_not_used(tmp_path: Path):
    """A hot prefix, answered from a slot or host memory, was never read back from disk, so its pages looked
    the oldest and went first: a restart computed the most used prompt again. Touched, they stay."""
    kept(tmp_path / "probe", [0, 1, 2, 3])
    size = next((tmp_path / "probe").glob("*.safetensors")).stat().st_size
    store = PageStore(tmp_path / "pages", int(size * 2.5), "ns", page=4)
    hot, cold, new = ([i] * 4 for i in (1, 2, 3))
    for prompt in (hot, cold):
        store.save(store.keys(prompt, "")[0], prompt, *page())
    store.touch(store.keys(hot, ""))
    store.touch(store.keys(hot, ""))  # again within TOUCH_S: no second write of its time
    store.save(store.keys(new, "")[0], new, *page())  # a third page: one must go
    store.close()
    after = PageStore(tmp_path / "pages", 2**30, "ns", page=4)
    assert [after.stored(store.keys(p, "")) for p in (hot, cold, new)] == [1, 0, 1]


def test_a_prompt_served_from_memory_touches_its_pages_on_disk(tiny_model_dir, tmp_path, monkeypatch):
    touched = []
    monkeypatch.setattr(PageStore, "touch", lambda self, keys: touched.append(list(keys)))
    options = {"ctx": 512, "slots": 2, "quiet": True, "cache_disk_gib": 1, "cache_dir": str(tmp_path)}
    with Engine(str(tiny_model_dir), **options) as engine:
        assert _run(engine)[0] == 0
        assert _run(engine)[0] > 256  # from its slot, more than the page on disk beside it
    names = {path.stem for path in tmp_path.glob("*.safetensors")}
    assert len(names) == 1 and any(keys == sorted(names) for keys in touched), (names, touched)


def test_a_page_that_cannot_be_removed_is_passed_over_and_the_cap_holds(tmp_path: Path):
    """The least recently used page cannot go (a directory in its place, a file marked immutable): the
    trim stopped there for good, and the folder grew past its cap ten times over."""
    folder = tmp_path / "pages"
    kept(tmp_path / "probe", [0, 1, 2, 3])
    size = next((tmp_path / "probe").glob("*.safetensors")).stat().st_size
    stuck = folder / ("0" * 40 + ".safetensors")
    stuck.mkdir(parents=True)
    os.utime(stuck, (time.time() - 3600,) * 2)
    store = PageStore(folder, int(size * 3.5), "ns", page=4)
    for i in range(12):
        store.save(store.keys([i] * 4, "")[0], [i] * 4, *page())
    store.close()
    pages = [f for f in folder.glob("*.safetensors") if f.is_file()]
    assert stuck.is_dir() and 1 <= len(pages) <= 3


def test_pages_leave_the_disk_room_said_once(tmp_path: Path, caplog, monkeypatch):
    """The cap (4 GiB by default) may be more than a small disk has: pages filled it to the last bytes, where
    packed weights keep 2 GiB free. Pages are not kept while less than a GiB would be left; kept again after."""
    from mashbox.engine.sched import disk_cache

    free = [disk_cache.ROOM + 100]
    monkeypatch.setattr(disk_cache.shutil, "disk_usage", lambda _: SimpleNamespace(free=free[0]))
    store = PageStore(tmp_path, 2**30, "ns", page=4)
    with caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        for i in range(3):
            store.save(store.keys([i] * 4, "")[0], [i] * 4, *page())
        store.close()
    assert not list(tmp_path.glob("*.safetensors")) and caplog.text.count("less than 1 GiB free") == 1
    free[0] = 2 * disk_cache.ROOM
    again = PageStore(tmp_path, 2**30, "ns", page=4)
    again.save(again.keys([0] * 4, "")[0], [0] * 4, *page())
    again.close()
    assert len(list(tmp_path.glob("*.safetensors"))) == 1


def test_files_of_others_in_the_folder_are_never_counted_or_removed(tmp_path: Path):
    """A cache folder that also holds a model's weights: the trim took them for pages and removed them."""
    theirs = [tmp_path / "my-finetune.safetensors", tmp_path / "empty.safetensors", tmp_path / ".draft.v2.tmp"]
    for file in theirs:
        file.write_bytes(b"x" * 1000 if file.stem != "empty" else b"")
        os.utime(file, (time.time() - 3600,) * 2)
    store = PageStore(tmp_path, 1, "ns", page=4)  # a cap it is always over
    for i in range(3):
        store.save(store.keys([i] * 4, "")[0], [i] * 4, *page())
    store.close()
    assert all(file.exists() for file in theirs)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3  # their two, and the one page a folder over its cap keeps


@pytest.mark.parametrize("other", [torch.randn(2, 4, 3, 16), torch.randn(2, 4, 3, 8).half()])
def test_a_page_of_another_shape_is_skipped_and_removed(tmp_path: Path, caplog, other):
    """A page of another model's shape under the right name and tokens (damaged, or made by hand) made
    the worker's read fail outside its checks: every request with that prefix restarted the worker."""
    prompt = list(range(8))
    keys = kept(tmp_path, prompt)
    second = tmp_path / f"{keys[1]}.safetensors"
    second.unlink()
    writer = PageStore(tmp_path, 2**20, "ns", page=4)
    writer.save(keys[1], prompt[4:], other, other.clone())
    writer.close()
    form = tuple(((2, 4, 3, 8), torch.float32) for _ in range(2))
    again = PageStore(tmp_path, 2**20, "ns", page=4, form=form)
    with caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        k, _ = again.read(keys, prompt)
    assert k.shape == (2, 4, 3, 8)  # the first page still serves
    assert "not of this model's shape" in caplog.text and not second.exists()


def test_a_folder_removed_while_in_use_is_made_again(tmp_path: Path, caplog):
    folder = tmp_path / "pages"
    store = PageStore(folder, 2**20, "ns", page=4)
    key = store.keys([1] * 4, "")[0]
    folder.rmdir()  # by hand, or a cleaner: every later page failed to be written
    with caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        store.save(key, [1] * 4, *page())
        store.close()
    assert (folder / f"{key}.safetensors").is_file() and "could not keep" not in caplog.text


def test_a_temporary_file_safetensors_left_goes_when_old(tmp_path: Path):
    """safetensors writes through a temporary file of its own (``.tmpXXXXXX``), and an older mashbox wrote
    pages through ``.KEY.tmp``: a writer killed then left it."""
    prompt = list(range(4))
    keys = kept(tmp_path, prompt)
    left, fresh, older = tmp_path / ".tmp3yXUti", tmp_path / ".tmpysUXYa", tmp_path / f".{'a' * 40}.tmp"
    left.write_bytes(b"x" * 1000), fresh.write_bytes(b""), older.write_bytes(b"x" * 1000)
    for path in (left, older):
        os.utime(path, (time.time() - 3600,) * 2)
    store = PageStore(tmp_path, 1, "ns", page=4)  # a cap it is over: the folder is counted again
    store.save(store.keys([9] * 4, "")[0], [9] * 4, *page())
    store.close()
    assert not left.exists() and not older.exists() and fresh.exists() and keys


def _run(engine: Engine, salt: str = "") -> tuple[int, str]:
    events = list(engine.stream(EngineRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=6), cache_salt=salt)))
    cached = next(e.cached for e in events if isinstance(e, Started))
    return cached, "".join(e.text for e in events if isinstance(e, TextDelta))


def test_a_restarted_engine_starts_a_known_prompt_from_disk_with_the_same_answer(tiny_model_dir, tmp_path, caplog):
    options = {"ctx": 512, "slots": 2, "quiet": True, "cache_disk_gib": 1, "cache_dir": str(tmp_path)}
    with Engine(str(tiny_model_dir), **options) as engine:
        cold, text = _run(engine, "alice")
    assert cold == 0 and len(list(tmp_path.glob("*.safetensors"))) == 1
    with Engine(str(tiny_model_dir), **options) as engine:
        assert _run(engine, "alice") == (256, text)  # the page from disk, the same tokens
        assert _run(engine, "bob")[0] == 0  # another tenant's prompt never hits it
    for file in tmp_path.glob("*.safetensors"):
        file.write_bytes(file.read_bytes()[:100])  # cut short
    with Engine(str(tiny_model_dir), **options) as engine, caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        assert _run(engine, "alice") == (0, text)
    assert "skipped the cached prompt page" in caplog.text


def test_a_restart_with_another_context_reads_the_same_pages(tiny_model_dir, tmp_path):
    """``--ctx`` was part of the pages' namespace: a server started again with a smaller context (to save
    memory) prefilled every prompt cold, its pages on disk for nothing; the keys do not depend on it."""
    options = {"slots": 1, "quiet": True, "cache_disk_gib": 1, "cache_dir": str(tmp_path)}
    with Engine(str(tiny_model_dir), ctx=1024, **options) as engine:
        cold, text = _run(engine)
    with Engine(str(tiny_model_dir), ctx=512, **options) as engine:
        assert cold == 0 and _run(engine) == (256, text)


def test_a_step_that_fails_leaves_nothing_it_wrote_to_be_reused(tiny_model_dir, tmp_path, monkeypatch):
    """Loading a page from disk into a slot failed: the slot was still taken to hold the prompt, so
    the request sent again was served from it (garbage, 200) and its later pages kept on disk."""
    options = {"ctx": 512, "slots": 1, "quiet": True, "cache_disk_gib": 1, "cache_dir": str(tmp_path)}
    with Engine(str(tiny_model_dir), **options) as engine:
        _, text = _run(engine)
    with Engine(str(tiny_model_dir), **options) as engine:
        monkeypatch.setattr(KVCache, "restore", lambda *args: (_ for _ in ()).throw(RuntimeError("out of memory")))
        failed = list(engine.stream(EngineRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=6))))[-1]
        assert failed.reason == "error" and "device step failed" in failed.error
        monkeypatch.undo()
        assert _run(engine) == (256, text)  # from disk again, not from the slot the failed load left


def test_pages_computed_by_other_kernels_are_not_used(tiny_model_dir, tmp_path, monkeypatch):
    options = {"ctx": 512, "slots": 2, "quiet": True, "cache_disk_gib": 1, "cache_dir": str(tmp_path / "pages")}
    with Engine(str(tiny_model_dir), **options) as engine:
        assert _run(engine, "alice")[0] == 0
    with Engine(str(tiny_model_dir), **options) as engine:
        assert _run(engine, "alice")[0] == 256
    edited = tmp_path / "kernels.c"  # a later version of the kernels: its last bits may differ
    edited.write_bytes(native.SOURCE.read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(native, "SOURCE", edited)
    with Engine(str(tiny_model_dir), **options) as engine:
        assert _run(engine, "alice")[0] == 0


def _share(folder: str, cap: int, seed: int, results) -> None:
    """One of two processes on one folder: reads each page it finds (it must be whole and the
    prompt's), writes each it does not; puts (pages read, pages written, warnings) or the error."""
    import random
    import time

    try:
        warnings = []
        handler = logging.Handler()
        handler.emit = lambda record: warnings.append(record.getMessage())
        logging.getLogger("mashbox.engine").addHandler(handler)
        store, rng = PageStore(Path(folder), cap, "ns", page=4), random.Random(seed)
        read = written = 0
        for _ in range(300):
            n = rng.randrange(12)
            prompt = [n] * 4
            keys = store.keys(prompt, "")
            if store.stored(keys):
                got = store.read(keys, prompt)
                if got is not None:
                    assert torch.equal(got[0], torch.full((2, 4, 3, 8), float(n))), "a page of other values"
                    read += 1
            else:
                store.save(keys[0], prompt, torch.full((2, 4, 3, 8), float(n)), torch.full((2, 4, 3, 8), -float(n)))
                written += 1
            time.sleep(0.002)  # the writer thread writes meanwhile
        store.close()
        results.put((read, written, warnings))
    except BaseException as err:
        results.put(repr(err))


def test_two_processes_share_one_folder_no_torn_pages_and_one_cap(tmp_path: Path):
    import multiprocessing

    probe = PageStore(tmp_path / "probe", 2**30, "ns", page=4)
    probe.save("probe", [0, 1, 2, 3], *page())
    probe.close()
    size = (tmp_path / "probe" / "probe.safetensors").stat().st_size
    cap = size * 8  # 8 of the 12 pages the two write: both trim, while the other reads
    folder = tmp_path / "shared"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_share, args=(str(folder), cap, seed, results)) for seed in (1, 2)]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    assert all(isinstance(outcome, tuple) for outcome in outcomes), outcomes
    assert all(warnings == [] for _, _, warnings in outcomes), outcomes  # no page failed to read
    assert all(read > 20 for read, _, _ in outcomes), outcomes  # each read pages, its own and the other's
    assert sum(written for _, written, _ in outcomes) > 12, outcomes  # pages were trimmed and written again
    files = list(folder.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in files) <= cap and not list(folder.glob(".*.tmp"))
    store = PageStore(folder, cap, "ns", page=4)
    for n in range(12):
        keys = store.keys([n] * 4, "")
        if store.stored(keys):
            assert torch.equal(store.read(keys, [n] * 4)[1], torch.full((2, 4, 3, 8), -float(n)))
    store.close()


def test_a_page_another_process_wrote_is_found_and_one_it_removed_is_a_quiet_miss(tmp_path: Path, caplog):
    ours, theirs = PageStore(tmp_path, 2**20, "ns", page=4), PageStore(tmp_path, 2**20, "ns", page=4)
    prompt = list(range(4))
    keys = ours.keys(prompt, "")
    assert ours.stored(keys) == 0
    theirs.save(keys[0], prompt, *page())
    theirs.close()
    assert ours.stored(keys) == 1 and ours.read(keys, prompt) is not None
    (tmp_path / f"{keys[0]}.safetensors").unlink()  # the other one trimmed it
    with caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        assert ours.read(keys, prompt) is None
    assert caplog.text == "" and ours.stored(keys) == 0
    ours.close()


def test_a_weights_file_rewritten_in_place_makes_the_pages_cold(tiny_model_dir, tmp_path):
    """A folder's pages were named by the folder's own stamp, which a file rewritten inside it (``cp new.safetensors
    dir/model.safetensors``) leaves as it was: the next start answered from pages of the old weights."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    options = {"ctx": 512, "slots": 1, "quiet": True, "cache_disk_gib": 1, "cache_dir": str(tmp_path / "pages")}
    with Engine(str(model), **options) as engine:
        assert _run(engine)[0] == 0
    with Engine(str(model), **options) as engine:
        assert _run(engine)[0] == 256  # the pages, read again
        namespace = cache_namespace(engine.info)
    folder = os.stat(model)
    for file in model.glob("*.safetensors"):
        with file.open("r+b") as f:  # the same bytes written again: only the file's stamp changes
            f.write(file.read_bytes())
    assert os.stat(model).st_mtime_ns == folder.st_mtime_ns
    with Engine(str(model), **options) as engine:
        assert _run(engine)[0] == 0
        assert cache_namespace(engine.info) != namespace  # /health's, for an endpoint picker: these weights are new
