"""The slice watch's protocol steps that a healthy API server rarely shows, driven through a
scripted server side (the lines an API server sends): a 410 Gone in the stream makes it LIST
again and watch from the new version; a cut stream resumes from the last version seen, a
bookmark's included, after a jittered back-off."""

from __future__ import annotations

import json
import random
import threading

from healthagent.common import ErrorTally
from healthagent.dra.slice_watch import SliceWatch
from healthagent.effects.backend import ApiUnavailable

WAIT = 10.0


class _Stream:
    def __init__(self, lines: list[str], cut: bool = False) -> None:
        self._lines, self._cut, self._ended = lines, cut, threading.Event()

    def lines(self):
        yield from self._lines
        if self._cut:
            raise ApiUnavailable("watch stream: ProtocolError: Response ended prematurely")
        self._ended.wait()  # then quiet until stopped

    def interrupt(self) -> None:
        self._ended.set()

    def close(self) -> None:
        self._ended.set()


def _event(kind: str, name: str, version: str, **spec) -> str:
    return json.dumps({"type": kind, "object": {"metadata": {"name": name, "resourceVersion": version},
                                                "spec": spec}})


class _Server:
    """What the API server answers, in order; records the versions each watch starts from."""

    def __init__(self, streams: list[_Stream]) -> None:
        self.streams = streams
        self.lists = 0
        self.started_from: list[str] = []
        self.done = threading.Event()

    def list_slices(self):
        self.lists += 1
        return [{"metadata": {"name": "s1", "resourceVersion": "20"}, "spec": {"relisted": True}}], "20"

    def watch_slices(self, version: str, timeout: int):
        self.started_from.append(version)
        if len(self.streams) == 1:
            self.done.set()
        return self.streams.pop(0) if len(self.streams) > 1 else self.streams[0]


def _watch(server: _Server, changed: list) -> SliceWatch:
    return SliceWatch(server, "n1", on_change=lambda: changed.append(1), tally=ErrorTally("dra"),
                      rng=random.Random(1), backoff=(0.01, 0.02))


def test_a_410_in_the_stream_lists_again_and_watches_from_the_new_version():
    gone = json.dumps({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                                   "message": "too old resource version"}})
    server = _Server([_Stream([_event("BOOKMARK", "", "7"), gone]), _Stream([])])
    changed: list = []
    watch = _watch(server, changed)
    watch.start([{"metadata": {"name": "s1"}, "spec": {}}], "5")
    assert server.done.wait(WAIT)
    watch.stop()
    assert server.lists == 1 and server.started_from == ["5", "20"]
    assert watch.slices() == [{"metadata": {"name": "s1", "resourceVersion": "20"}, "spec": {"relisted": True}}]
    assert changed  # the relist changed the slices: the effects were woken


def test_a_cut_stream_resumes_from_the_last_version_seen():
    server = _Server([_Stream([_event("ADDED", "s2", "8", devices=[]), _event("BOOKMARK", "", "9")], cut=True),
                      _Stream([])])
    changed: list = []
    watch = _watch(server, changed)
    watch.start([], "5")
    assert server.done.wait(WAIT)
    watch.stop()
    assert server.lists == 0 and server.started_from == ["5", "9"]
    assert [s["metadata"]["name"] for s in watch.slices()] == ["s2"] and len(changed) == 1
