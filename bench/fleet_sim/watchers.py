"""The node watches of the nodes whose agents are not simulated in full: one per node, opened as
the agent opens its own (``ApiBackend.watch_own_node``: ``fieldSelector=metadata.name=NODE``,
from a list's ``resourceVersion``, with bookmarks, ended by the server after a random 5-10
minutes, resumed from the last version seen, retried after the agent's delays:
``effects/watch_retry.py``), all on one event loop so that 10,000 of them cost
the API server what 10,000 agents' watches cost it, and the bench a thread."""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import threading
from dataclasses import dataclass, field
from urllib.parse import urlencode

from healthagent.effects.node_watch import HEALTHY_STREAM_SECONDS, WATCH_TIMEOUT_SECONDS, ran_full_term
from healthagent.effects.watch_retry import RetryPolicy, Run
from tests.support.envtest import ControlPlane

from bench.fleet_sim.cluster import AGENT_ACCOUNT, NAMESPACE, NODE_NAME_EXTRA



@dataclass
class WatchFigures:
    opened: int = 0  # watch requests sent (first opens and resumes)
    events: int = 0  # events delivered (bookmarks included)
    bytes: int = 0  # bytes of events delivered
    failures: int = 0  # opens refused or cut (an API server restart)
    live: set[str] = field(default_factory=set)


class PassiveWatches:
    """One watch per name in ``names`` on a private event loop thread; ``stop`` ends them."""

    def __init__(self, plane: ControlPlane, names: list[str], version: str, seed: int = 7) -> None:
        self._plane = plane
        self._names = names
        self._version = version
        self._rng = random.Random(seed)
        self.figures = WatchFigures()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="passive-watches", daemon=True)
        pki = plane.pki
        assert pki is not None
        self._ssl = ssl.create_default_context(cafile=str(pki.ca_cert))
        self._ssl.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
    def start(self) -> None:
        self._thread.start()
        # held here: the event loop keeps only weak references to its tasks
        self._futures = [asyncio.run_coroutine_threadsafe(self._watch(name), self._loop) for name in self._names]

    def stop(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    async def _watch(self, name: str) -> None:
        version, run, policy = self._version, Run(), RetryPolicy()
        loop = asyncio.get_running_loop()
        while True:
            attempt = Attempt()
            began = loop.time()
            try:
                version = await self._one(name, version, attempt)
                if attempt.full_term:
                    run = Run()
                    continue
            except asyncio.CancelledError:
                raise
            except Exception:
                self.figures.failures += 1
                self.figures.live.discard(name)
            run = run.failed(opened=attempt.opened, progressed=loop.time() - began >= HEALTHY_STREAM_SECONDS)
            await asyncio.sleep(run.delay(policy, self._rng, attempt.retry_after))

    async def _one(self, name: str, version: str, attempt: "Attempt") -> str:
        """One watch request to its end; the version to resume from. ``attempt`` says whether it
        was answered, ran its full term, or named a ``Retry-After``."""
        timeout = self._rng.randint(*WATCH_TIMEOUT_SECONDS)
        query = urlencode({"allowWatchBookmarks": "true", "fieldSelector": f"metadata.name={name}",
                           "resourceVersion": version, "watch": "true", "timeoutSeconds": str(timeout)})
        reader, writer = await asyncio.open_connection("127.0.0.1", self._plane.port, ssl=self._ssl)
        loop = asyncio.get_running_loop()
        try:
            extra = NODE_NAME_EXTRA.replace("/", "%2F")
            writer.write((f"GET /api/v1/nodes?{query} HTTP/1.0\r\nHost: 127.0.0.1\r\nAccept: application/json\r\n"
                          f"Impersonate-User: system:serviceaccount:{NAMESPACE}:{AGENT_ACCOUNT}\r\n"
                          f"Impersonate-Group: system:serviceaccounts\r\nImpersonate-Extra-{extra}: {name}\r\n\r\n"
                          ).encode())
            self.figures.opened += 1
            status = await reader.readline()
            while (header := await reader.readline()) not in (b"\r\n", b""):
                key, _, value = header.decode(errors="replace").partition(":")
                if key.strip().lower() == "retry-after" and value.strip().isdigit():
                    attempt.retry_after = float(value.strip())
            if b" 200 " not in status:
                raise ConnectionError(status.decode(errors="replace").strip())
            attempt.opened = True
            opened = loop.time()
            self.figures.live.add(name)
            while True:
                line = await reader.readline()
                if not line:
                    attempt.full_term = ran_full_term(loop.time() - opened, timeout)
                    return version
                self.figures.events += 1
                self.figures.bytes += len(line)
                event = json.loads(line)
                if event.get("type") == "ERROR":  # 410: the agent lists again; here: from the cache's newest
                    attempt.full_term = True
                    return "0"
                version = str(((event.get("object") or {}).get("metadata") or {}).get("resourceVersion") or version)
        finally:
            self.figures.live.discard(name)
            writer.close()


@dataclass
class Attempt:
    """What one watch request came to."""

    opened: bool = False
    full_term: bool = False
    retry_after: float = 0.0
