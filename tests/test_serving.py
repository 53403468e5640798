"""The connection guard of `lockstep serve` (lockstep.infer.serving) against slow and abusive clients, on a
live uvicorn on 127.0.0.1 with bounds of a second or less: header and body tricklers closed within
their bound while /health keeps answering, the connection cap, the bounded log of accept errors
(a child process out of descriptors), and the cap planned under the open-file limit."""

from __future__ import annotations

import contextlib
import gc
import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockstep.core.config import FieldError
from lockstep.infer.serving import (
    ACCEPT_BURSTS_IN_FLIGHT,
    ARRIVAL_GRACE_S,
    DEFAULT_MAX_CONNECTIONS,
    FD_SPARE,
    FDS_PER_CONNECTION,
    MAX_BACKLOG,
    GuardedH11Protocol,
    GuardedServer,
    ServingLimits,
    build_server,
    count_open_fds,
    plan_connections,
)

LIB = Path(__file__).resolve().parents[1] / "lib"


async def tiny_app(scope, receive, send) -> None:
    """/health answers at once; any other path echoes the request body; /stream sends ten chunks
    0.15 s apart."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/stream":
        import asyncio

        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(10):
            await asyncio.sleep(0.15)
            await send({"type": "http.response.body", "body": b"chunk %d\n" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    reply = b"ok" if scope["path"] == "/health" else body
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(reply)).encode())]}
    )
    await send({"type": "http.response.body", "body": reply})


def plan_for_tests(limits: ServingLimits):
    """A plan under this process's soft limit, which the tests leave as they found it."""
    import resource

    return plan_connections(limits, fd_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0], open_fds=count_open_fds())


@contextlib.contextmanager
def serve_in_thread(app, limits: ServingLimits | None = None, **uvicorn_options) -> Iterator[tuple[int, GuardedServer]]:
    """Serve `app` under the guard on a free 127.0.0.1 port in a thread; yields (port, server)."""
    limits = limits or ServingLimits()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    options = {"log_level": "warning", **uvicorn_options}
    server = build_server(app, limits, plan_for_tests(limits), **options)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start within 10 s")
        time.sleep(0.01)
    try:
        yield port, server
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def get(port: int, path: str = "/health", timeout_s: float = 3.0) -> tuple[bytes, float]:
    """(the raw reply, seconds it took) of a GET on a new connection; the reply is empty when
    the server reset the connection."""
    start_s = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        reply = read_until_closed(conn, timeout_s)[0]
    return reply, time.monotonic() - start_s


def read_until_closed(conn: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """(what came, seconds until the server closed) on a blocking socket."""
    start_s = time.monotonic()
    conn.settimeout(timeout_s)
    reply = b""
    try:
        while chunk := conn.recv(65536):
            reply += chunk
    except ConnectionResetError:
        pass
    return reply, time.monotonic() - start_s


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    """Whether `predicate` came true within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def read_reply(conn: socket.socket) -> bytes:
    """One whole reply with a Content-Length body from a kept-alive connection."""
    reply = b""
    while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < _content_length(reply):
        chunk = conn.recv(65536)
        assert chunk, f"closed after {reply!r}"
        reply += chunk
    return reply


def _content_length(reply: bytes) -> int:
    for line in reply.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            return int(value)
    return 0


class Trickler:
    """A client that sends `head`, then `drip` at every tick until the server closes on it."""

    def __init__(self, port: int, head: bytes, drip: bytes):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=2)
        self.sock.sendall(head)
        self.sock.setblocking(False)
        self.drip = drip
        self.started_s = time.monotonic()
        self.closed_s: float | None = None
        self.received = b""

    def tick(self) -> None:
        if self.closed_s is not None:
            return
        try:
            while chunk := self.sock.recv(65536):
                self.received += chunk
            self.closed_s = time.monotonic()
        except BlockingIOError:
            try:
                self.sock.send(self.drip)
            except (BrokenPipeError, ConnectionResetError):
                self.closed_s = time.monotonic()
        except ConnectionResetError:
            self.closed_s = time.monotonic()
        if self.closed_s is not None:
            self.sock.close()

    @property
    def open_s(self) -> float:
        return (self.closed_s or time.monotonic()) - self.started_s


def poll_health(port: int, stop: threading.Event, latencies_s: list[float], failures: list[str]) -> None:
    while not stop.is_set():
        try:
            reply, took_s = get(port)
            latencies_s.append(took_s)
            if not reply.startswith(b"HTTP/1.1 200"):
                failures.append(reply[:60].decode(errors="replace"))
        except OSError as e:
            failures.append(repr(e))
        time.sleep(0.1)


def test_tricklers_are_closed_within_their_bounds_while_health_answers(caplog):
    limits = ServingLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_connections=200, log_interval_s=60)
    margin_s = 1.0
    caplog.set_level(logging.WARNING, logger="lockstep.infer.serving")
    with serve_in_thread(tiny_app, limits) as (port, server):
        stop, latencies_s, failures = threading.Event(), [], []
        poller = threading.Thread(target=poll_health, args=(port, stop, latencies_s, failures), daemon=True)
        poller.start()
        # A slowloris sends a header line well inside any per-read timeout; a body trickler a byte.
        headers = [Trickler(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X-a: b\r\n") for _ in range(40)]
        bodies = [Trickler(port, b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n", b"x")
                  for _ in range(10)]
        tricklers = headers + bodies
        deadline_s = time.monotonic() + limits.header_timeout_s + margin_s + 1
        while time.monotonic() < deadline_s and any(t.closed_s is None for t in tricklers):
            for t in tricklers:
                t.tick()
            time.sleep(0.1)
        time.sleep(0.5)  # /health polled after the tricklers are gone too
        stop.set()
        poller.join(timeout=10)
        open_times_s = sorted(round(t.open_s, 2) for t in tricklers)
        assert all(t.closed_s is not None for t in tricklers), f"still open after {open_times_s[-1]} s"
        assert limits.header_timeout_s - 0.1 <= open_times_s[0], open_times_s
        assert open_times_s[-1] <= limits.header_timeout_s + margin_s, open_times_s
        assert all(t.received == b"" or t.received.startswith(b"HTTP/1.1 408") for t in tricklers)
        assert not failures and len(latencies_s) >= 10, failures
        assert max(latencies_s) < 1.0, f"/health took up to {max(latencies_s):.2f} s"
        # Every connection and its buffers are let go once the clients are closed on, while serving.
        assert wait_for(lambda: not (server.server_state.connections or server.guard.waiting or server.guard.arriving))
        gc.collect()
        assert [o for o in gc.get_objects() if type(o) is GuardedH11Protocol] == []
    # 50 timeouts: the first of each kind logged, the rest counted for the summary.
    lines = [r.getMessage() for r in caplog.records if r.name == "lockstep.infer.serving"]
    assert len(lines) == 2 and "the request headers did not arrive within 1 s" in lines[0] and "body" in lines[1], lines


def test_a_late_request_is_answered_408_at_its_bound():
    limits = ServingLimits(header_timeout_s=0.4, body_timeout_s=0.4)
    with serve_in_thread(tiny_app, limits) as (port, _):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            reply, took_s = read_until_closed(conn, timeout_s=3)
        assert reply.startswith(b"HTTP/1.1 408") and b"headers did not arrive within 0.4 s" in reply
        assert 0.35 <= took_s < 1.0, took_s
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\nabc")
            reply, took_s = read_until_closed(conn, timeout_s=3)
        assert reply.startswith(b"HTTP/1.1 408") and b"body did not arrive within 0.4 s" in reply
        assert b"200" not in reply and 0.35 <= took_s < 1.0, reply
        with socket.create_connection(("127.0.0.1", port)) as conn:  # connects, sends nothing
            reply, took_s = read_until_closed(conn, timeout_s=3)
        assert reply == b"" and 0.35 <= took_s < 1.0, (reply, took_s)
        # On a kept-alive connection the next request's headers are timed from the previous reply.
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_reply(conn).startswith(b"HTTP/1.1 200")
            conn.sendall(b"GET /health HTTP/1.1\r\n")
            time.sleep(0.2)
            conn.sendall(b"X-a: b\r\n")
            reply, took_s = read_until_closed(conn, timeout_s=3)
        assert reply.startswith(b"HTTP/1.1 408") and took_s < 0.6, (reply, took_s)


def test_a_long_streamed_reply_and_a_body_inside_its_bound_are_not_cut():
    limits = ServingLimits(header_timeout_s=0.3, body_timeout_s=0.3)
    with serve_in_thread(tiny_app, limits) as (port, _), socket.create_connection(("127.0.0.1", port)) as conn:
        # The reply streams for 1.5 s, five times the bounds; the next request on the connection
        # is served after it.
        conn.sendall(b"POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\nhi")
        reply = b""
        while not reply.endswith(b"0\r\n\r\n"):
            chunk = conn.recv(65536)
            assert chunk, f"the stream was cut after {reply.count(b'chunk ')} chunks"
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and reply.count(b"chunk ") == 10
        conn.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n\r\nab")
        time.sleep(0.15)
        conn.sendall(b"cd")
        assert read_reply(conn).endswith(b"\r\n\r\nabcd")


def test_the_cap_refuses_a_connection_when_every_one_is_busy():
    limits = ServingLimits(header_timeout_s=5, body_timeout_s=5, max_connections=4)
    with serve_in_thread(tiny_app, limits) as (port, _):
        busy = []
        for _ in range(4):  # each in the middle of sending its body
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\na")
            busy.append(conn)
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port)) as conn:
            reply, took_s = read_until_closed(conn, timeout_s=3)
        assert reply.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in reply and took_s < 0.5, reply
        # A client whose request is on its way when the server closes may read a reset instead.
        reply, took_s = get(port)
        assert (reply == b"" or reply.startswith(b"HTTP/1.1 503")) and took_s < 0.5, reply
        for conn in busy:
            conn.sendall(b"b")
            assert read_reply(conn).endswith(b"\r\n\r\nab")
        # Served and idle now, they make room for new connections.
        assert get(port)[0].startswith(b"HTTP/1.1 200")
        for conn in busy:
            conn.close()


def test_at_the_cap_a_new_connection_replaces_the_longest_waiting_one():
    limits = ServingLimits(header_timeout_s=5, body_timeout_s=5, max_connections=4)
    with serve_in_thread(tiny_app, limits) as (port, _):
        waiting = []
        for _ in range(4):  # slowloris connections holding every place
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"GET /health HTTP/1.1\r\n")
            waiting.append(conn)
            time.sleep(0.05)
        reply, took_s = get(port)
        assert reply.startswith(b"HTTP/1.1 200") and took_s < 1.0, reply
        assert read_until_closed(waiting[0], timeout_s=1)[0] == b""
        for conn in waiting[1:]:
            conn.setblocking(False)
            with pytest.raises(BlockingIOError):  # still open: only the oldest made room
                conn.recv(1)
            conn.close()


def test_at_the_cap_a_silent_connection_is_replaced_only_after_a_grace():
    limits = ServingLimits(header_timeout_s=5, body_timeout_s=5, max_connections=2)
    with serve_in_thread(tiny_app, limits) as (port, _):
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # connect, send nothing
        time.sleep(0.2)
        # Under ARRIVAL_GRACE_S old, they may be clients whose request is still on its way.
        with socket.create_connection(("127.0.0.1", port)) as conn:
            assert read_until_closed(conn, timeout_s=3)[0].startswith(b"HTTP/1.1 503")
        time.sleep(ARRIVAL_GRACE_S)
        reply, took_s = get(port)
        assert reply.startswith(b"HTTP/1.1 200") and took_s < 1.0, reply
        assert read_until_closed(silent[0], timeout_s=1)[0] == b""
        for conn in silent:
            conn.close()


CHILD = textwrap.dedent("""
    import logging, os, resource, socket, sys, threading, time
    from lockstep.infer.serving import ServingLimits, build_server, plan_connections

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    limits = ServingLimits(log_interval_s=1.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = build_server(app, limits, plan_connections(limits, fd_limit=20000, open_fds=20), log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    # Out of descriptors as a process that leaks them would be: every accept fails with EMFILE.
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print(sock.getsockname()[1], flush=True)
    sys.stdin.readline()
    for fd in held:
        os.close(fd)
    server.should_exit = True
    thread.join(timeout=10)
""")


def test_accept_errors_are_logged_once_then_summarised_per_interval():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={"PYTHONPATH": str(LIB), "PATH": "/usr/bin:/bin"})
    try:
        port = int(child.stdout.readline())
        clients, start_s = [], time.monotonic()
        while time.monotonic() - start_s < 3.0:  # the kernel queues them; the server cannot take them
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            time.sleep(0.1)
        child.stdin.write("\n")
        child.stdin.flush()
        log_text = child.communicate(timeout=30)[1]
    finally:
        child.kill()
        for conn in clients:
            conn.close()
    lines = log_text.splitlines()
    assert "Too many open files (EMFILE)" in lines[0], log_text[:2000]
    # 3 s of failed accepts, at most one summary a second: thousands of tracebacks without the guard.
    summary = "lockstep.infer.serving in the last 1 s: 1 more accept EMFILE"
    summaries = [line for line in lines[1:] if line.startswith(summary)]
    assert 1 <= len(summaries) <= 4 and len(lines) == 1 + len(summaries), log_text[:2000]


def test_the_cap_and_a_full_backlog_fit_under_the_open_file_limit():
    plan = plan_connections(ServingLimits(), fd_limit=20000, open_fds=30)
    assert (plan.max_connections, plan.backlog) == (DEFAULT_MAX_CONNECTIONS, MAX_BACKLOG)
    for fd_limit in (256, 1024, 4096, 65536):
        plan = plan_connections(ServingLimits(), fd_limit=fd_limit, open_fds=40)
        fds = FDS_PER_CONNECTION * plan.max_connections + ACCEPT_BURSTS_IN_FLIGHT * plan.backlog + FD_SPARE + 40
        assert fds <= fd_limit
        assert plan.max_connections >= 1 and plan.backlog >= 1
    assert plan_connections(ServingLimits(max_connections=5), fd_limit=1024, open_fds=40).max_connections == 5
    with pytest.raises(FieldError, match=r"must be at most 287: the open-file limit is 1024, 40 are open"):
        plan_connections(ServingLimits(max_connections=5000), fd_limit=1024, open_fds=40)
    with pytest.raises(FieldError, match=r"leaves no room for connections; raise it \(ulimit -n\)"):
        plan_connections(ServingLimits(), fd_limit=100, open_fds=40)
    with pytest.raises(FieldError, match="header_timeout_s=0 must be an integer > 0"):
        ServingLimits(header_timeout_s=0)
    with pytest.raises(FieldError, match="log_interval_s=0.5 must be a finite number >= 1"):
        ServingLimits(log_interval_s=0.5)


def test_the_soft_open_file_limit_is_raised_toward_the_hard_one():
    code = ("import resource; from lockstep.infer.serving import raise_fd_limit; "
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard)); print(*raise_fd_limit())")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=30,
                         env={"PYTHONPATH": str(LIB), "PATH": "/usr/bin:/bin"})
    before, now, hard = (int(x) for x in out.stdout.split())
    assert before == 64 and now == min(hard, 65536), out
