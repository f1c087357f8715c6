"""``serve --kv-events ENDPOINT``: the prefix cache's changes published over ZeroMQ in vLLM's KV-event
wire format, so that a router which reads vLLM's events (llm-d's precise prefix scorer, NVIDIA
Dynamo's KV router, Ray's KV-aware router) routes replicas of pyllama-kv by what each one holds.

The wire (as vLLM's ``ZmqEventPublisher``): a PUB socket bound to ENDPOINT; each message is three
frames, the topic (``kv-events``), the sequence number (8 bytes, big-endian, from 0) and a msgpack
payload ``[ts, [event, ...]]`` (an ``EventBatch``, ``array_like``), each event an array whose first
item is its tag: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``. The blocks, hashes
and media are :mod:`pyllama_kv.prefixcache.events`'. No replay socket: a subscriber that missed a
sequence number waits for the next ``AllBlocksCleared`` (sent at start) or resubscribes after a
restart. Needs the ``events`` extra (pyzmq, msgpack).

The engine's loop thread reads the events after each step (:class:`~pyllama_kv.engine.kvevents.KVEventSource`,
a tuple comparison when nothing changed) and hands them to a sender thread, so a slow network
never holds a step.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

from ..engine.kvevents import KVEventSource, to_wire
from ..errors import InvalidInputError

__all__ = ["KVEventPublisher"]

log = logging.getLogger("pyllama_kv.server")

TOPIC = b"kv-events"


class KVEventPublisher:
    """A PUB socket on ``endpoint`` fed by ``on_step(engine)`` (pass it to ``Engine.start``)."""

    def __init__(self, endpoint: str, block_size: int):
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise InvalidInputError(f"--kv-events needs the events extra ({exc.name} is missing): "
                                    "pip install 'pyllama-kv[events]'") from None
        self._msgpack = msgpack
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise InvalidInputError(f"--kv-events: cannot bind {endpoint!r}: {exc}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.block_size = block_size
        self._source: KVEventSource | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._seq = 0
        self._thread = threading.Thread(target=self._send_loop, name="pyllama-kv-kv-events", daemon=True)
        self._thread.start()

    def on_step(self, engine) -> None:
        """Called on the engine's loop thread after each step: queue what changed."""
        if self._source is None or self._source.engine is not engine:
            self._source = KVEventSource(engine, self.block_size)
        events = self._source.poll()
        if events:
            self._queue.put((time.time(), to_wire(events)))

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            payload = self._msgpack.packb(list(item), use_bin_type=True)
            try:
                self._sock.send_multipart([TOPIC, self._seq.to_bytes(8, "big"), payload])
            except Exception as exc:   # the socket closed under us, or a transient error: log, go on
                log.warning("kv-events: a batch was not sent: %s", exc)
            self._seq += 1

    def close(self) -> None:
        """Send what is queued, then close the socket."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(5.0)
        self._sock.close()
        self._ctx.term()
