"""The connection side of `lockstep serve`: uvicorn's h11 protocol with a deadline on each request's
headers and on its body, a cap on open connections sized from the open-file limit, and a log that
counts bursts of connection and accept errors instead of writing a line for each. Not the API and
its request limits (lockstep.infer.server); knows nothing about chat.

uvicorn (0.54) bounds only what it reads per event (`h11_max_incomplete_event_size`) and the idle
time between requests (`timeout_keep_alive`); a client that trickles a header line or a body byte
every few seconds keeps its connection and file descriptor for ever, and `limit_concurrency`
answers 503 only once a request's headers are in. Measured with plain uvicorn
(bench/bench_slow_clients.py: 600 header tricklers, 50 body tricklers, then 20,400 connections
with partial headers from two local clients): no trickler was closed in 30 s, the process reached
its 20,000 descriptors, /health answered 11 of 21 polls during the flood, and asyncio logged "Too
many open files" 102,398 times (43 MB of log in 45 s)."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lockstep.core.config import FieldError, check_range

log = logging.getLogger(__name__)

# The listening socket's queue, which is also the most connections asyncio accepts in one turn of
# its loop (selector_events._accept_connection loops `backlog` times). Smaller bursts keep most of
# the cap read and replaceable and the loop's turns short: /health polled once a second under a
# flood of 20,400 partial-header connections from two local clients was answered 69 times in 72
# with a backlog of 128, 14 in 19 with 512, 1 in 8 with uvicorn's 2048 (2-core CPU, loaded).
MAX_BACKLOG = 128
# A connection reaches the protocol, where it is refused or takes another's place, two turns after
# its accept, so three bursts of accepted descriptors are open beside the cap at the worst
# (measured: 4,929 descriptors at the peak of a flood with a cap of 1000 and a backlog of 2048).
ACCEPT_BURSTS_IN_FLIGHT = 3
DEFAULT_MAX_CONNECTIONS = 1000
# Descriptors one connection may hold: its socket, and the file a static response is being sent
# from while the client is slow to read.
FDS_PER_CONNECTION = 2
# At the cap, a connection of which nothing has been read yet is replaced only after this long:
# one accepted in the same burst as a flood's must have its request read before the flood's
# newer connections may take its place.
ARRIVAL_GRACE_S = 1.0
# Descriptors kept free beside the connections for what serving opens on its own (the tokenizer and
# checkpoint files while loading, log files, a library's pipes). A running `lockstep serve` on the
# tiny model holds 9 besides its connections: the standard streams, the event loop's epoll, pipe
# and socket pair, the listening socket (ls /proc/PID/fd, after a reply and the UI page).
FD_SPARE = 64
# The soft open-file limit is raised toward the hard one up to this, many times what the default
# cap and backlog need; macOS reports an unlimited hard limit that setrlimit refuses.
FD_LIMIT_TARGET = 65536
# The errors asyncio's accept loop reports through the loop's exception handler instead of raising.
ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True)
class ServingLimits:
    """Bounds on what one client connection may hold. A request's headers must be complete within
    `header_timeout_s` of the connection opening (or of the previous reply on a kept-alive
    connection), its body within `body_timeout_s` of its headers; replies are not timed, so a
    reply may stream for as long as it generates."""

    # 10 s: a request's headers are a few hundred bytes, one round trip on any working link;
    # Apache's mod_reqtimeout allows 20-40 s, uvicorn nothing.
    header_timeout_s: float = 10.0
    # 15 s: the largest body the API takes (1 MiB) at about 0.6 Mbit/s.
    body_timeout_s: float = 15.0
    max_connections: int = 0  # open connections at most; 0 = DEFAULT_MAX_CONNECTIONS or what the fd limit fits
    log_interval_s: float = 10.0  # a burst of connection or accept errors is logged once per this

    def __post_init__(self) -> None:
        check_range("header_timeout_s", self.header_timeout_s, gt=0,
                    why="seconds a client has to send a request's headers")
        check_range("body_timeout_s", self.body_timeout_s, gt=0,
                    why="seconds a client has to send a request's body after its headers")
        check_range("max_connections", self.max_connections, ge=0,
                    why=f"open connections at most; 0 = {DEFAULT_MAX_CONNECTIONS} or what the open-file limit fits")
        # asyncio retries a failed accept each second: a shorter interval would split one shortage
        # of descriptors into many bursts, each logging its first line.
        check_range("log_interval_s", self.log_interval_s, ge=1, why="seconds between summary lines of a burst")


@dataclass(frozen=True)
class ConnectionPlan:
    """How many connections the process takes, chosen from its open-file limit."""

    fd_limit: int  # the soft RLIMIT_NOFILE serving runs under
    fd_limit_before: int  # the soft limit found at start, before raising it
    fd_hard_limit: int
    open_fds: int  # descriptors open when the plan was made
    max_connections: int
    backlog: int  # the listening socket's queue, and the most connections accepted in one turn

    def describe(self) -> str:
        raised = (f"raised from {self.fd_limit_before}" if self.fd_limit > self.fd_limit_before
                  else "the hard limit" if self.fd_limit >= self.fd_hard_limit else "not raised")
        return (f"open-file limit {self.fd_limit} ({raised}; hard {self.fd_hard_limit}), {self.open_fds} open: "
                f"at most {self.max_connections} connections, backlog {self.backlog}")


def raise_fd_limit(target: int = FD_LIMIT_TARGET) -> tuple[int, int, int]:
    """Raise the soft open-file limit toward the hard one, at most to `target`, where allowed.
    Returns (soft limit before, soft limit now, hard limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < ceiling:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
        except (ValueError, OSError):  # a platform cap below the hard limit (macOS: kern.maxfilesperproc)
            pass
    now, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, now, hard


def count_open_fds() -> int:
    """Descriptors this process has open (Linux and macOS list them under /dev/fd)."""
    try:
        return len(os.listdir("/dev/fd")) - 1  # less the one listdir itself opened
    except OSError:
        return FD_SPARE


def plan_connections(limits: ServingLimits, *, fd_limit: int, open_fds: int, fd_limit_before: int | None = None,
                     fd_hard_limit: int | None = None) -> ConnectionPlan:
    """The connection cap and backlog that fit under `fd_limit` with `open_fds` already open: the
    cap's connections, the accept bursts in flight and FD_SPARE fit together, so serving never runs
    out of descriptors itself. FieldError names max_connections when it does not fit."""
    free = fd_limit - open_fds - FD_SPARE
    backlog = min(MAX_BACKLOG, free // 8)
    room = (free - ACCEPT_BURSTS_IN_FLIGHT * backlog) // FDS_PER_CONNECTION
    if room < 1:
        raise FieldError("max_connections", limits.max_connections,
                         f"does not fit: the open-file limit is {fd_limit} with {open_fds} open and {FD_SPARE} kept "
                         "spare, which leaves no room for connections; raise it (ulimit -n)")
    if limits.max_connections > room:
        raise FieldError("max_connections", limits.max_connections,
                         f"must be at most {room}: the open-file limit is {fd_limit}, {open_fds} are open, "
                         f"{FD_SPARE} are kept spare, {ACCEPT_BURSTS_IN_FLIGHT * backlog} for connections being "
                         f"accepted and {FDS_PER_CONNECTION} for each connection; lower it or raise the limit "
                         "(ulimit -n)")
    return ConnectionPlan(
        fd_limit=fd_limit,
        fd_limit_before=fd_limit if fd_limit_before is None else fd_limit_before,
        fd_hard_limit=fd_limit if fd_hard_limit is None else fd_hard_limit,
        open_fds=open_fds,
        max_connections=limits.max_connections or min(DEFAULT_MAX_CONNECTIONS, room),
        backlog=backlog,
    )


def plan_for_this_process(limits: ServingLimits) -> ConnectionPlan:
    """Raise this process's open-file limit where allowed and plan the connections under it."""
    before, now, hard = raise_fd_limit()
    return plan_connections(limits, fd_limit=now, open_fds=count_open_fds(), fd_limit_before=before,
                            fd_hard_limit=hard)


class BurstLog:
    """Logs the first event of each kind at once, then at most one line per `interval_s` counting
    the events of the interval; two intervals without one end the burst, so that events a second
    apart (asyncio's accept retries) stay one burst at any interval of a second or more. A client
    can cause an event per connection, and an exhausted descriptor table one per accept attempt:
    a line (and a traceback) for each was 43 MB of log in 45 s."""

    def __init__(self, logger: logging.Logger, level: int, interval_s: float):
        self.logger = logger
        self.level = level
        self.interval_s = interval_s
        self.counts: Counter[str] = Counter()
        self._started: set[str] = set()
        self._summary: asyncio.TimerHandle | None = None
        self._quiet_intervals = 0

    def note(self, loop: asyncio.AbstractEventLoop, kind: str, first_line: str) -> None:
        if kind not in self._started:
            self._started.add(kind)
            self.logger.log(self.level, "%s (more of these are counted and logged every %g s)", first_line,
                            self.interval_s)
        else:
            self.counts[kind] += 1
        if self._summary is None:
            self._summary = loop.call_later(self.interval_s, self._summarise, loop)

    def _summarise(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.counts:
            self.logger.log(self.level, "in the last %g s: %s", self.interval_s,
                            ", ".join(f"{n} more {kind}" for kind, n in sorted(self.counts.items())))
            self.counts.clear()
            self._quiet_intervals = 0
        else:
            self._quiet_intervals += 1
        if self._quiet_intervals >= 2:  # the burst is over: the next event is logged at once
            self._started.clear()
            self._quiet_intervals = 0
            self._summary = None
        else:
            self._summary = loop.call_later(self.interval_s, self._summarise, loop)


class ConnectionGuard:
    """What the connections of one server share: the limits, the cap, the connections waiting for
    a request (the ones a new connection may replace at the cap) and the burst logs."""

    def __init__(self, limits: ServingLimits, plan: ConnectionPlan):
        self.limits = limits
        self.max_connections = plan.max_connections
        # Waiting for a request, each insertion-ordered (the longest wait first): those that sent
        # part of one or idle after a reply, and those of which nothing has been read yet, by the
        # loop time they were accepted.
        self.waiting: dict[GuardedH11Protocol, None] = {}
        self.arriving: dict[GuardedH11Protocol, float] = {}
        self.events = BurstLog(log, logging.WARNING, limits.log_interval_s)
        self.accept_errors = BurstLog(log, logging.ERROR, limits.log_interval_s)

    def make_room(self, now_s: float) -> bool:
        """Close the connection that has waited longest for a request, one that sent part of it or
        idles after a reply first; False when none may go (every connection is busy with a request
        or arrived under ARRIVAL_GRACE_S ago)."""
        while True:
            if self.waiting:
                oldest = next(iter(self.waiting))
            elif self.arriving and next(iter(self.arriving.values())) <= now_s - ARRIVAL_GRACE_S:
                oldest = next(iter(self.arriving))
            else:
                return False
            oldest.stop_waiting()
            if not oldest.transport.is_closing():
                oldest.transport.close()
                return True

    def exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The event loop's exception handler: accept errors go to a burst log, the rest to asyncio's
        own handler."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in ACCEPT_ERRNOS and "accept" in context.get("message", ""):
            self.accept_errors.note(loop, f"accept {errno.errorcode[exc.errno]}",
                                    f"cannot accept connections: {exc.strerror} ({errno.errorcode[exc.errno]}); "
                                    "asyncio retries each second")
            return
        loop.default_exception_handler(context)


def _plain_response(status: int, reason: str, text: str, extra_headers: bytes = b"") -> bytes:
    body = text.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n").encode() + extra_headers + b"\r\n" + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a ConnectionGuard. Each state of a connection has a deadline:
    waiting for a request's headers (from connecting, or from the previous reply), then for its
    body; the reply has none. At the cap a new connection takes the place of the one that has
    waited longest for its request, or is answered 503 and closed when every one is busy."""

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, guard: ConnectionGuard):
        super().__init__(config, server_state, app_state, _loop)
        self.guard = guard
        self._refused = False
        self._headers_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        guard = self.guard
        if len(self.connections) >= guard.max_connections:
            if not guard.make_room(self.loop.time()):
                # Before uvicorn sees it: no request is parsed, nothing joins its connections.
                self._refused = True
                self.transport = transport
                transport.write(_plain_response(503, "Service Unavailable", "too many connections; retry shortly\n",
                                                b"retry-after: 1\r\n"))
                transport.close()
                guard.events.note(self.loop, "connections refused",
                                  f"refused a connection: all {guard.max_connections} connections are busy with "
                                  "requests")
                return
            guard.events.note(self.loop, "connections closed to make room",
                              f"at the cap of {guard.max_connections} connections: closed the one that had waited "
                              "longest for a request to take a new one")
        super().connection_made(transport)
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_headers_deadline()
        self._cancel_body_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()
        if self in self.guard.arriving:  # part of a request came: a slowloris looks the same
            del self.guard.arriving[self]
            self.guard.waiting[self] = None

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next request on the connection
        self._follow_request()

    def _follow_request(self) -> None:
        """Arm or cancel the deadlines for the state the client's side of the connection is now in."""
        state = self.conn.their_state
        if state is h11.IDLE and not self.transport.is_closing():
            if self._headers_deadline is None:  # a wait for a request begins
                self._headers_deadline = self.loop.call_later(self.guard.limits.header_timeout_s, self._headers_late)
                if self.cycle is None:  # a new connection
                    self.guard.arriving[self] = self.loop.time()
                else:
                    self.guard.waiting[self] = None
        else:
            self._cancel_headers_deadline()
        if state is h11.SEND_BODY:
            if self._body_deadline is None:
                self._body_deadline = self.loop.call_later(self.guard.limits.body_timeout_s, self._body_late)
        else:
            self._cancel_body_deadline()

    def _cancel_headers_deadline(self) -> None:
        if self._headers_deadline is not None:
            self._headers_deadline.cancel()
            self._headers_deadline = None
        self.stop_waiting()

    def stop_waiting(self) -> None:
        self.guard.waiting.pop(self, None)
        self.guard.arriving.pop(self, None)

    def _cancel_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _headers_late(self) -> None:
        self._headers_deadline = None
        self.stop_waiting()
        if not self.transport.is_closing():
            # A 408 where part of a request came; a connection that sent nothing is just closed.
            self._close_late("headers", self.guard.limits.header_timeout_s, answer=bool(self.conn.trailing_data[0]))

    def _body_late(self) -> None:
        self._body_deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        answer = cycle is not None and not cycle.response_started
        if answer:
            # The app's reply, should it still send one, is dropped: the 408 is this request's answer.
            cycle.disconnected = True
            cycle.message_event.set()  # wakes the app's receive() waiting for the rest of the body
        self._close_late("body", self.guard.limits.body_timeout_s, answer=answer)

    def _close_late(self, part: str, seconds: float, *, answer: bool) -> None:
        """Close the connection whose request `part` (headers, body) did not arrive within
        `seconds`, with a 408 first when `answer`."""
        if answer:
            self.transport.write(_plain_response(408, "Request Timeout",
                                                 f"the request {part} did not arrive within {seconds:g} s\n"))
        self.transport.close()
        self.guard.events.note(self.loop, f"{part} timeouts", f"closed a connection from {_peer(self.client)}: the "
                                                              f"request {part} did not arrive within {seconds:g} s")


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


class _AcceptUntilOutOfResources:
    """A listening socket as asyncio's accept loop sees it: once an accept fails for want of
    descriptors or memory, the loop's next accepts find nothing to take, so it stops there and
    retries a second later. asyncio as released with Python 3.11 goes on calling accept up to
    `backlog` times and schedules a retry for each failure (CPython gh-151615, since fixed there);
    the retries multiply and the loop spends its time failing accepts: 2,047, 6,144 and 10,240
    failures in three successive seconds with the descriptors used up, against one a second with
    this."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.out_of_resources = False

    def accept(self) -> tuple[socket.socket, Any]:
        if self.out_of_resources:
            raise BlockingIOError(errno.EAGAIN, "no more accepts until the retry")
        try:
            return self.sock.accept()
        except OSError as e:
            if e.errno in ACCEPT_ERRNOS:
                self.out_of_resources = True
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class GuardedEventLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop, whose accept loop stops at the first accept that fails for want of
    resources (_AcceptUntilOutOfResources)."""

    def _accept_connection(self, protocol_factory: Any, sock: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(sock, _AcceptUntilOutOfResources):  # handed back by the retry asyncio scheduled
            sock = sock.sock
        once = _AcceptUntilOutOfResources(sock)
        super()._accept_connection(protocol_factory, once, *args, **kwargs)  # type: ignore[misc]

    def _start_serving(self, protocol_factory: Any, sock: Any, *args: Any, **kwargs: Any) -> None:
        if sock.fileno() == -1:  # the server closed while a retry after a resource error was pending
            return
        super()._start_serving(protocol_factory, sock, *args, **kwargs)  # type: ignore[misc]


class GuardedServer(uvicorn.Server):
    """uvicorn's server on a GuardedEventLoop, with the guard's exception handler on it."""

    def __init__(self, config: uvicorn.Config, guard: ConnectionGuard):
        super().__init__(config)
        self.guard = guard

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        with asyncio.Runner(loop_factory=GuardedEventLoop) as runner:
            runner.run(self.serve(sockets=sockets))

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(self.guard.exception_handler)
        await super().serve(sockets)


def build_server(app: Any, limits: ServingLimits, plan: ConnectionPlan, **uvicorn_options: Any) -> GuardedServer:
    """A uvicorn server for `app` under `limits` and `plan`; `uvicorn_options` (host, port,
    log_level, ...) go to uvicorn.Config."""
    guard = ConnectionGuard(limits, plan)
    config = uvicorn.Config(
        app,
        http=functools.partial(GuardedH11Protocol, guard=guard),
        # No WebSocket routes: an upgraded connection would leave the guard's protocol.
        ws="none",
        backlog=plan.backlog,
        **uvicorn_options,
    )
    return GuardedServer(config, guard)


def run_server(app: Any, limits: ServingLimits, plan: ConnectionPlan, *, host: str, port: int,
               log_level: str = "info") -> None:
    """Serve `app` on host:port until interrupted (what `lockstep serve` runs)."""
    log.info("%s; request headers within %g s, bodies within %g s", plan.describe(), limits.header_timeout_s,
             limits.body_timeout_s)
    build_server(app, limits, plan, host=host, port=port, log_level=log_level).run()
