"""An S3-compatible server on 127.0.0.1 for the object-storage tests (moto's server mode), and a TCP
proxy in front of it that cuts connections part-way through a response, or refuses them all: what
a flaky network or an outage looks like to a reader of shards."""
from __future__ import annotations

import logging
import random
import socket
import threading
from contextlib import contextmanager
from typing import Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server on a free port of 127.0.0.1; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request in the test's output
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


class FlakyProxy:
    """Forwards 127.0.0.1:port to ``target``; each connection, with probability ``cut``, is closed
    after a random number (under ``within``) of response bytes. ``down = True`` closes every new
    connection at once (the server is gone). Counts the connections it cut."""

    def __init__(self, target_port: int, *, cut: float, within: int = 200_000, seed: int = 0) -> None:
        self.target_port, self.cut, self.within = target_port, cut, within
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.down, self.cuts, self.connections = False, 0, 0
        self.open: set[socket.socket] = set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                limit = self.rng.randrange(1, self.within) if self.rng.random() < self.cut else None
            if self.down:
                client.close()
                continue
            threading.Thread(target=self._serve, args=(client, limit), daemon=True).start()

    def _serve(self, client: socket.socket, limit: int | None) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        with self.lock:
            self.open |= {client, upstream}
        threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
        self._pipe(upstream, client, limit)

    def _pipe(self, source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := source.recv(65536):
                if limit is not None and sent + len(data) > limit:
                    sink.sendall(data[:limit - sent])
                    with self.lock:
                        self.cuts += 1
                    break
                sink.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
            with self.lock:
                self.open.discard(s)

    def go_down(self) -> None:
        """The server is gone: every open connection is cut, every new one refused."""
        self.down = True
        with self.lock:
            for s in list(self.open):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.listener.close()
