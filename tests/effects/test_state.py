"""StateStore: atomic, thread-safe, never raises on a bad disk or a corrupt file."""

import json
import os
import threading

import pytest

from healthagent.effects.state import StateStore


def test_missing_file_is_empty_and_flush_creates_the_directory(tmp_path):
    path = tmp_path / "deep" / "dir" / "state.json"
    store = StateStore(path)
    assert store.load() == {}
    store.put("kmsg_cursor", {"seq": 41, "boot_id": "b1"})
    assert store.flush() is True
    assert json.loads(path.read_text()) == {"kmsg_cursor": {"seq": 41, "boot_id": "b1"}}
    reloaded = StateStore(path)
    assert reloaded.load() == {"kmsg_cursor": {"seq": 41, "boot_id": "b1"}}
    assert reloaded.get("kmsg_cursor")["seq"] == 41
    assert reloaded.get("absent", "dflt") == "dflt"


def test_put_and_get_are_copies(tmp_path):
    store = StateStore(tmp_path / "s.json")
    value = {"emitted": ["a"]}
    store.put("effects", value)
    value["emitted"].append("b")  # the caller mutates its dict after put
    got = store.get("effects")
    assert got == {"emitted": ["a"]}
    got["emitted"].append("c")  # and mutating what get returned changes nothing either
    assert store.get("effects") == {"emitted": ["a"]}


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2, 3]", b"\xff\xfe\x00garbage", b'"text"'])
def test_corrupt_file_is_moved_aside_counted_and_state_starts_empty(tmp_path, content):
    path = tmp_path / "state.json"
    path.write_bytes(content)
    store = StateStore(path)
    assert store.load() == {}
    assert store.errors == {"corrupt": 1}
    assert (tmp_path / "state.json.corrupt").read_bytes() == content
    assert not path.exists()
    store.put("boot_id", "b2")
    assert store.flush() is True
    assert json.loads(path.read_text()) == {"boot_id": "b2"}


def test_unwritable_path_is_counted_and_the_agent_keeps_its_state_in_memory(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the state directory should be")
    store = StateStore(blocker / "state.json")
    assert store.load() == {}
    store.put("classifier", {"open": 3})
    assert store.flush() is False
    assert store.flush() is False
    assert store.errors == {"unreadable": 1, "unwritable": 2}
    assert store.get("classifier") == {"open": 3}


def test_value_json_cannot_hold_is_counted_and_the_old_value_stays(tmp_path):
    store = StateStore(tmp_path / "s.json")
    store.put("effects", {"ok": 1})
    store.put("effects", {"bad": object()})
    assert store.get("effects") == {"ok": 1}
    assert store.errors == {"not_json": 1}


def test_state_over_the_size_bound_is_not_written(tmp_path):
    path = tmp_path / "s.json"
    store = StateStore(path, max_bytes=64)
    store.put("small", 1)
    assert store.flush() is True
    store.put("big", "x" * 200)
    assert store.flush() is False
    assert store.errors == {"too_large": 1}
    assert json.loads(path.read_text()) == {"small": 1}  # the last good file is kept


def test_flush_is_atomic_and_skips_the_disk_when_nothing_changed(tmp_path):
    path = tmp_path / "s.json"
    store = StateStore(path)
    store.put("a", 1)
    store.flush()
    inode = os.stat(path).st_ino
    assert store.flush() is True
    assert os.stat(path).st_ino == inode  # no rewrite: a steady state costs no I/O
    store.put("a", 2)
    store.flush()
    assert os.stat(path).st_ino != inode  # a new file renamed over the old one
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temp file left behind


def test_two_threads_putting_and_flushing_leave_a_complete_file(tmp_path):
    path = tmp_path / "s.json"
    store = StateStore(path)
    errors = []

    def worker(name):
        try:
            for i in range(50):
                store.put(name, {"i": i})
                store.flush()
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"t{n}",)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    store.flush()
    on_disk = json.loads(path.read_text())
    assert on_disk == {f"t{n}": {"i": 49} for n in range(6)}


def test_unreadable_file_is_counted_not_moved(tmp_path):
    path = tmp_path / "s.json"
    path.mkdir()  # reading a directory fails with an OSError other than "missing"
    store = StateStore(path)
    assert store.load() == {}
    assert store.errors == {"unreadable": 1}
    assert path.is_dir()
