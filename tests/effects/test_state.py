"""StateStore: atomic, thread-safe, never raises on a bad disk or a corrupt file."""

import errno
import json
import os
import threading

import pytest

from healthagent.effects.state import StateStore
from tests.support.wait import wait_for


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


def test_a_file_nested_past_the_parser_s_limit_is_set_aside_not_a_crash(tmp_path):
    path = tmp_path / "state.json"
    path.write_bytes(b"[" * 200_000)
    store = StateStore(path)
    assert store.load() == {}
    assert store.errors == {"corrupt": 1}
    assert (tmp_path / "state.json.corrupt").stat().st_size == 200_000 and not path.exists()
    store.put("boot_id", "b1")
    assert store.flush() is True


def test_a_file_nested_deeper_than_any_state_is_set_aside(tmp_path):
    from healthagent.effects.state import MAX_DEPTH

    path = tmp_path / "state.json"
    deep = '{"classifier": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}"  # valid JSON, parses
    path.write_text(deep)
    store = StateStore(path)
    assert store.load() == {} and store.errors == {"corrupt": 1}
    shallow = '{"classifier": ' + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}"
    path.write_text(shallow)
    assert StateStore(path).load() != {}


def test_a_file_over_the_size_limit_is_refused_at_load_and_later_saves_work(tmp_path):
    path = tmp_path / "state.json"
    big = json.dumps({"effects": {"outbox": ["x" * 1000] * 3000}}).encode()  # 3 MB of valid JSON
    path.write_bytes(big)
    store = StateStore(path, max_bytes=1_000_000)
    assert store.load() == {}
    assert store.errors == {"too_large": 1}
    assert (tmp_path / "state.json.corrupt").read_bytes() == big
    store.put("boot_id", "b1")
    assert store.flush() is True and store.errors == {"too_large": 1}
    assert json.loads(path.read_text()) == {"boot_id": "b1"}


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_path_that_is_not_a_regular_file_is_set_aside_without_blocking(tmp_path, kind):
    """A FIFO would block an ordinary open until a writer came; /dev/zero would never end."""
    path = tmp_path / "state.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)
    store = StateStore(path)
    assert store.load() == {} and store.errors == {"corrupt": 1}
    store.put("boot_id", "b1")
    assert store.flush() is True
    assert json.loads(path.read_text()) == {"boot_id": "b1"}


def test_a_directory_at_the_path_is_unreadable_and_left_alone(tmp_path):
    path = tmp_path / "state.json"
    path.mkdir()
    store = StateStore(path)
    assert store.load() == {} and store.errors == {"unreadable": 1}
    assert path.is_dir()


class FailingOs:
    """A fake ``os`` for ``healthagent.common``: the real module, but ``fsync`` fails the way a
    dying or full disk fails it (a real disk cannot be made to fail on demand)."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.calls = 0

    def __getattr__(self, name):
        return getattr(os, name)

    def fsync(self, fd):
        self.calls += 1
        raise OSError(self.error, os.strerror(self.error))


@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC])
def test_a_failing_fsync_keeps_the_old_file_leaves_no_temp_and_is_logged_once(tmp_path, monkeypatch, caplog,
                                                                             error):
    path = tmp_path / "state.json"
    store = StateStore(path)
    store.load()
    store.put("boot_id", "b1")
    assert store.flush() is True
    failing = FailingOs(error)
    monkeypatch.setattr("healthagent.common.os", failing)
    for n in range(5):
        store.put("boot_id", f"b{n + 2}")
        assert store.flush() is False
    assert failing.calls == 5 and store.errors == {"unwritable": 5}
    assert json.loads(path.read_text()) == {"boot_id": "b1"}  # never renamed over: it may not be on disk
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    assert len([r for r in caplog.records if "error=unwritable" in r.getMessage()]) == 1
    monkeypatch.undo()
    assert store.flush() is True
    assert json.loads(path.read_text()) == {"boot_id": "b6"}


def test_a_value_nested_past_the_encoder_s_limit_is_refused_at_put(tmp_path):
    store = StateStore(tmp_path / "s.json")
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    store.put("classifier", {"ok": 1})
    store.put("classifier", deep)
    assert store.errors == {"not_json": 1} and store.get("classifier") == {"ok": 1}


class HangingFsync:
    """A fake ``os`` for ``healthagent.common``: fsync blocks until ``release`` (a dying NVMe can
    take minutes to fail one); a real disk cannot be made to hang on demand."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(os, name)

    def fsync(self, fd):
        self.entered.set()
        self.go.wait(60)
        os.fsync(fd)


def test_a_write_that_hangs_holds_its_own_thread_not_the_caller(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    store = StateStore(path, write_wait_seconds=0.2)
    store.load()
    hanging = HangingFsync()
    monkeypatch.setattr("healthagent.common.os", hanging)
    store.put("boot_id", "b1")
    assert store.flush() is False  # the caller goes on; the write goes on without it
    assert hanging.entered.is_set() and store.errors == {"slow": 1}
    store.put("boot_id", "b2")
    assert store.flush() is False  # one write at a time: nothing older may land over newer
    assert store.errors == {"slow": 2}
    hanging.go.set()
    wait_for(lambda: path.exists(), what="the hung write to finish")
    assert json.loads(path.read_text()) == {"boot_id": "b1"}
    monkeypatch.undo()
    wait_for(store.flush, what="the next write")
    assert json.loads(path.read_text()) == {"boot_id": "b2"}
