"""The raw DCP reader: tensors stored back to back are read in runs, one read per run; a cold
file is read around the page cache (O_DIRECT), a warm one through it, and a file read around
the cache is brought into it in the background once the load has finished."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from recover_fixtures import SPEC, committed_generation, dump_once, make_setup, recover_config

import areal_ckpt as ac
from areal_ckpt.errors import CheckpointError
from areal_ckpt.formats import cache_fill, dcp_metadata, dcp_reader, range_read
from areal_ckpt.formats.dcp_io import load_tensors
from areal_ckpt.formats.dcp_save import save_tensors


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(64, 33, generator=generator),  # 8448 bytes: a run of its own below
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
        "half": torch.randn(5, 7, generator=generator).to(torch.bfloat16),
        "ints": torch.arange(11, dtype=torch.int64),
        "square": torch.randn(6, 6, generator=generator),
        "row": torch.randn(1, 5, generator=generator),
    }


def _empty_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    template = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    template["square"] = torch.zeros(6, 6).t()  # not contiguous: read through a buffer, then copied
    return template


@pytest.mark.parametrize("run_bytes, run_items", [(64 << 20, 512), (200, 2), (1, 1)])
def test_runs_of_any_size_fill_every_tensor_exactly(tmp_path: Path, monkeypatch, run_bytes: int, run_items: int):
    monkeypatch.setattr(dcp_reader, "_RUN_BYTES", run_bytes)
    monkeypatch.setattr(dcp_reader, "_RUN_ITEMS", run_items)
    state = _state()
    records = save_tensors(state, tmp_path)
    template = _empty_like(state)
    load_tensors(template, tmp_path, expected=records)
    for name, tensor in state.items():
        assert torch.equal(template[name], tensor), name


def test_a_truncated_file_read_without_a_manifest_is_named(tmp_path: Path):
    state = _state()
    (file_name,) = save_tensors(state, tmp_path)
    data = tmp_path / file_name
    last = max(info.offset + info.length for info in dcp_metadata.read_metadata_json(tmp_path).storage_data.values())
    data.write_bytes(data.read_bytes()[: last - 10])  # into the last tensor's bytes
    with pytest.raises(CheckpointError, match=f"{file_name}: ends early \\(truncated\\)"):
        load_tensors(_empty_like(state), tmp_path)


def _evict(path: Path) -> None:
    """Flush ``path`` and drop it from the page cache: the next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cold_after_evict(monkeypatch) -> None:
    """Make the reader take every file for cold, as after :func:`_evict`: the kernel drops a
    file's pages only on a best-effort basis (under a loaded test run it kept them now and then),
    and these tests are about what the direct reader reads, not about the cache check, which
    ``test_a_cold_file_is_read_around_the_page_cache_and_a_warm_one_through_it`` tests."""
    monkeypatch.setattr(range_read, "_is_cached", lambda fd, spans: False)


def _big_state() -> dict[str, torch.Tensor]:
    """~90 KB over tensors that straddle 4 KiB blocks."""
    generator = torch.Generator().manual_seed(1)
    state = _state()
    state.update({f"w{i}": torch.randn(37 + i, 61, generator=generator) for i in range(8)})
    return state


def _record_readers(monkeypatch) -> list[type]:
    chosen: list[type] = []

    def recording(path: Path, spans: list[tuple[int, int]]) -> range_read.RangeReader:
        reader = range_read.open_ranges(path, spans)
        chosen.append(type(reader))
        return reader

    monkeypatch.setattr(dcp_reader, "open_ranges", recording)
    return chosen


def test_a_cold_file_is_read_around_the_page_cache_and_a_warm_one_through_it(tmp_path: Path):
    state = _big_state()
    (file_name,) = save_tensors(state, tmp_path)
    spans = [(0, 4096)]
    warm = range_read.open_ranges(tmp_path / file_name, spans)
    warm.close()
    for _ in range(20):  # the kernel drops pages on a best-effort basis: asked again until it did (the event)
        _evict(tmp_path / file_name)
        cold = range_read.open_ranges(tmp_path / file_name, spans)
        cold.close()
        if isinstance(cold, range_read.DirectRanges):
            break
    assert (type(warm), type(cold)) == (range_read.BufferedRanges, range_read.DirectRanges)


def test_a_file_read_again_right_after_a_load_goes_through_the_cache_and_a_probed_one_does_not(tmp_path: Path):
    state = _big_state()
    (file_name,) = save_tensors(state, tmp_path)
    path = tmp_path / file_name
    spans = [(0, path.stat().st_size)]
    for _ in range(20):  # the kernel drops pages on a best-effort basis: asked again until it did (the event)
        _evict(path)
        with open(path, "rb") as file:
            file.read(4096)  # the first page read, as a probe or a header read leaves it cached
        reader = range_read.open_ranges(path, spans)
        reader.close()
        if isinstance(reader, range_read.DirectRanges):
            break
    assert isinstance(reader, range_read.DirectRanges)  # one cached page does not make a file warm
    path.read_bytes()  # a load through the page cache
    again = range_read.open_ranges(path, spans)
    again.close()
    assert isinstance(again, range_read.BufferedRanges)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert range_read._resident_fraction(fd, 0, path.stat().st_size) == 1.0
    finally:
        os.close(fd)


def _cached_fraction(path: Path) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        fraction = range_read._resident_fraction(fd, 0, path.stat().st_size)
    finally:
        os.close(fd)
    assert fraction is not None
    return fraction


def _evicted(path: Path) -> None:
    """Evict ``path`` until the kernel reports none of its pages cached (it drops pages on a
    best-effort basis: asked again until it did)."""
    for _ in range(20):
        _evict(path)
        if _cached_fraction(path) == 0.0:
            return
    pytest.fail(f"{path}: the kernel kept its pages cached through 20 evictions")


@pytest.mark.parametrize("local_world_size", [None, "2", "two"])  # torchrun's variable, or a stray value
def test_a_cold_load_leaves_its_files_cached_once_the_background_fill_is_done_so_a_reload_reads_through_the_cache(
    tmp_path: Path, monkeypatch, local_world_size: str | None
):
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    chosen = _record_readers(monkeypatch)
    state = _big_state()
    records = save_tensors(state, tmp_path)
    (file_name,) = records
    _evicted(tmp_path / file_name)
    load_tensors(_empty_like(state), tmp_path, expected=records, fill_page_cache=True)
    cache_fill.wait_for_fills()
    assert _cached_fraction(tmp_path / file_name) == 1.0
    again = _empty_like(state)
    load_tensors(again, tmp_path, expected=records, fill_page_cache=True)
    assert chosen == [range_read.DirectRanges, range_read.BufferedRanges]
    for name, tensor in state.items():
        assert torch.equal(again[name], tensor), name


def test_the_fill_waits_while_a_read_around_the_cache_is_open_in_the_process(tmp_path: Path, monkeypatch):
    state = _big_state()
    (tmp_path / "loaded").mkdir()
    (tmp_path / "open").mkdir()
    records = save_tensors(state, tmp_path / "loaded")
    save_tensors(state, tmp_path / "open")
    (file_name,) = records
    loaded, still_open = tmp_path / "loaded" / file_name, tmp_path / "open" / file_name
    _evicted(still_open)
    reader = range_read.open_ranges(still_open, [(0, 4096)])
    try:
        assert isinstance(reader, range_read.DirectRanges)
        monkeypatch.setattr(range_read, "_is_cached", lambda fd, spans: False)  # the load reads around the cache
        _evicted(loaded)
        load_tensors(_empty_like(state), tmp_path / "loaded", expected=records, fill_page_cache=True)
        assert cache_fill.fill_waiting().wait(timeout=60)  # a guard against a hang, not a race: set as it waits
        assert _cached_fraction(loaded) == 0.0
    finally:
        reader.close()
    cache_fill.wait_for_fills()
    assert _cached_fraction(loaded) == 1.0


def test_files_above_the_nodes_share_of_available_memory_are_not_brought_into_the_cache(
    tmp_path: Path, monkeypatch, caplog
):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(1 << 40))  # so many ranks on the node that each may fill ~nothing
    state = _big_state()
    records = save_tensors(state, tmp_path)
    (file_name,) = records
    _evicted(tmp_path / file_name)
    with caplog.at_level("INFO", logger=cache_fill.__name__):
        load_tensors(_empty_like(state), tmp_path, expected=records, fill_page_cache=True)
    cache_fill.wait_for_fills()
    assert "above the share of available memory" in caplog.text
    assert _cached_fraction(tmp_path / file_name) == 0.0


def test_a_restart_fills_the_cache_with_the_data_files_it_read_around_it(fileroot: Path):
    setup = dump_once(fileroot)
    data_files = sorted(committed_generation(fileroot).rglob("*.distcp"))
    assert data_files
    for path in data_files:
        _evicted(path)
    fresh = make_setup(seed=1)
    loader = ac.RecoverHandler(recover_config(fileroot), SPEC)
    assert loader.load(fresh.engine) is not None
    cache_fill.wait_for_fills()
    assert [_cached_fraction(path) for path in data_files] == [1.0] * len(data_files)
    assert torch.equal(fresh.model.lm_head.weight, setup.model.lm_head.weight)
    loader.close()


def test_a_load_not_asked_to_fill_the_cache_leaves_it_as_it_read_it(tmp_path: Path):
    state = _big_state()
    records = save_tensors(state, tmp_path)
    (file_name,) = records
    _evicted(tmp_path / file_name)
    load_tensors(_empty_like(state), tmp_path, expected=records)  # an export reading a recovery checkpoint
    cache_fill.wait_for_fills()
    assert _cached_fraction(tmp_path / file_name) == 0.0


def _flip_a_byte_near_the_end(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 5] ^= 1
    path.write_bytes(bytes(data))


def test_a_load_that_fails_brings_nothing_into_the_cache(tmp_path: Path):
    state = _big_state()
    records = save_tensors(state, tmp_path)
    (file_name,) = records
    path = tmp_path / file_name
    _flip_a_byte_near_the_end(path)
    _evicted(path)
    with pytest.raises(CheckpointError, match=f"{file_name}: checksum mismatch"):
        load_tensors(_empty_like(state), tmp_path, expected=records, fill_page_cache=True)
    cache_fill.wait_for_fills()
    assert _cached_fraction(path) == 0.0


def _mapping_of(address: int) -> dict[str, str]:
    """The fields /proc/self/smaps gives for the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(bound, 16) for bound in head.split("-"))
            inside = low <= address < high
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_cold_read_buffers_start_on_a_huge_page_and_are_offered_to_huge_pages():
    views, tensors = range_read._huge_page_slots(3)
    addresses = [tensor.data_ptr() for tensor in tensors]
    assert addresses[0] % range_read._HUGE_PAGE == 0
    assert [b - a for a, b in zip(addresses, addresses[1:])] == [range_read.BLOCK] * 2
    assert [len(view) for view in views] == [range_read.BLOCK] * 3
    views[1][:4] = b"abcd"  # the views and the tensors are the same bytes
    assert bytes(tensors[1][:4].numpy()) == b"abcd"
    switch = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = switch.read_text() if switch.exists() else "[never]"  # a kernel built without them
    assert _mapping_of(addresses[0])["THPeligible"] == ("0" if "[never]" in mode else "1")


@pytest.mark.parametrize("block, in_flight", [(4096, 1), (4096, 3), (range_read.BLOCK, range_read.IN_FLIGHT)])
def test_cold_reads_in_blocks_fill_every_tensor_exactly(tmp_path: Path, monkeypatch, block: int, in_flight: int):
    monkeypatch.setattr(range_read, "BLOCK", block)
    monkeypatch.setattr(range_read, "IN_FLIGHT", in_flight)
    monkeypatch.setattr(dcp_reader, "_RUN_ITEMS", 3)  # runs end inside blocks too
    _cold_after_evict(monkeypatch)
    chosen = _record_readers(monkeypatch)
    state = _big_state()
    records = save_tensors(state, tmp_path)
    (file_name,) = records
    _evict(tmp_path / file_name)
    template = _empty_like(state)
    load_tensors(template, tmp_path, expected=records)
    assert chosen == [range_read.DirectRanges]
    for name, tensor in state.items():
        assert torch.equal(template[name], tensor), name


def _saved_in_small_blocks(tmp_path: Path, monkeypatch) -> tuple[list[type], dict[str, torch.Tensor], dict, Path]:
    """The big state saved, 4 KiB read blocks (many per file), and the list of readers chosen."""
    monkeypatch.setattr(range_read, "BLOCK", 4096)
    _cold_after_evict(monkeypatch)
    chosen = _record_readers(monkeypatch)
    state = _big_state()
    records = save_tensors(state, tmp_path)
    (file_name,) = records
    return chosen, state, records, tmp_path / file_name


def test_a_cold_partial_read_skips_blocks_and_still_checks_the_whole_file(tmp_path: Path, monkeypatch):
    chosen, state, records, path = _saved_in_small_blocks(tmp_path, monkeypatch)
    template = {name: torch.zeros_like(tensor) for name, tensor in state.items() if name not in ("w2", "w3", "w4")}
    _evict(path)
    load_tensors(template, tmp_path, optional_prefixes=("w2", "w3", "w4"), expected=records)
    for name, tensor in template.items():
        assert torch.equal(tensor, state[name]), name
    data = bytearray(path.read_bytes())
    skipped = dcp_metadata.read_metadata_json(tmp_path).storage_data
    offset = next(info.offset for index, info in skipped.items() if index.fqn == "w3")
    data[offset] ^= 1  # inside a tensor this load does not read
    path.write_bytes(bytes(data))
    _evict(path)
    with pytest.raises(CheckpointError, match=f"{path.name}: checksum mismatch"):
        load_tensors(
            {name: torch.zeros_like(t) for name, t in template.items()},
            tmp_path,
            optional_prefixes=("w2", "w3", "w4"),
            expected=records,
        )
    assert chosen == [range_read.DirectRanges, range_read.DirectRanges]


def test_a_cold_damaged_file_is_named(tmp_path: Path, monkeypatch):
    chosen, state, records, path = _saved_in_small_blocks(tmp_path, monkeypatch)
    _flip_a_byte_near_the_end(path)
    _evict(path)
    with pytest.raises(CheckpointError, match=f"{path.name}: checksum mismatch"):
        load_tensors(_empty_like(state), tmp_path, expected=records)
    assert chosen == [range_read.DirectRanges]


def test_a_cold_truncated_file_is_named(tmp_path: Path, monkeypatch):
    chosen, state, _, path = _saved_in_small_blocks(tmp_path, monkeypatch)
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 5000])
    _evict(path)
    with pytest.raises(CheckpointError, match=f"{path.name}: ends early \\(truncated\\)"):
        load_tensors(_empty_like(state), tmp_path)
    assert chosen == [range_read.DirectRanges]


def test_a_fifo_put_in_place_of_a_loaded_file_is_skipped_by_the_fill_not_waited_on(tmp_path: Path, caplog):
    fifo = tmp_path / "__0_0.distcp"
    os.mkfifo(fifo)  # in place of a file a load read around the cache; with no writer, a plain open blocks
    cache_fill.direct_read_opened()
    cache_fill.direct_read_closed(fifo, 4096)  # as the reader notes the file it read
    with caplog.at_level("INFO", logger=cache_fill.__name__):
        cache_fill.fill_noted()
        waiter = threading.Thread(target=cache_fill.wait_for_fills, daemon=True)
        waiter.start()
        waiter.join(timeout=60)  # a guard against a hang, not a race: the fill ends at once
    assert not waiter.is_alive(), "the fill thread blocked on the FIFO"
    assert f"not filling the page cache with {fifo}: not a regular file" in caplog.text
