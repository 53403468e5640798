"""Slow and abusive clients against the chat server, as uvicorn served it before lockstep.infer.serving
(`--server plain`) and as `lockstep serve` serves it now (`--server guarded`), each in a child
process on 127.0.0.1 under this shell's open-file limit. Three phases: header tricklers (a request
line, then one header line every 2 s) beside body tricklers (a byte a second); a flood of
connections with partial headers from two client processes that reopen each one the server
closes, the tricklers still open holding on; then a quiet spell. /health is polled throughout.
Prints, per server: tricklers closed and when, /health answers and latency, the server's descriptors
and RSS (start, peak, after), and its log (lines, bytes). Not a test.

    .venv/bin/python bench/bench_slow_clients.py [--server plain guarded] [--flood 10200] [--trickle-s 30]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
PARTIAL_HEADERS = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def serve_child(kind: str, port: int) -> None:
    """The server: the API over a scripted backend, served by plain uvicorn or under the guard."""
    sys.path.insert(0, str(ROOT / "lib"))
    from lockstep.infer.chat import Delta
    from lockstep.infer.server import create_app

    class Backend:  # what the API needs of a model; no model is loaded, /health is what is polled
        model_id = "bench"
        context_tokens = 512

        def count_tokens(self, text: str) -> int:
            return len(text)

        def prompt_tokens(self, messages: list[dict]) -> int:
            return sum(len(m["content"]) for m in messages)

        def stream(self, messages, settings) -> Iterator[Delta]:
            yield Delta(text="ok", tokens=1, finish_reason="stop")

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s %(message)s")
    app = create_app(Backend())
    if kind == "plain":  # what `lockstep serve` ran before
        import uvicorn

        uvicorn.run(app, host="127.0.0.1", port=port, log_level="info")
    else:
        from lockstep.infer import serving

        limits = serving.ServingLimits()
        serving.run_server(app, limits, serving.plan_for_this_process(limits), host="127.0.0.1", port=port)


def flood_child(port: int, connections: int, duration_s: float) -> None:
    """Hold up to `connections` connections with partial headers, reopening each one the server
    closes, for `duration_s`; prints {"opened", "failed"}."""
    sel = selectors.DefaultSelector()
    opened = failed = 0
    end_s = time.monotonic() + duration_s
    while time.monotonic() < end_s:
        while len(sel.get_map()) < connections and time.monotonic() < end_s:
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=1)
                conn.sendall(PARTIAL_HEADERS)
                conn.setblocking(False)
                sel.register(conn, selectors.EVENT_READ)
                opened += 1
            except OSError:
                failed += 1
                break
        for key, _ in sel.select(timeout=0.2):
            sel.unregister(key.fileobj)
            key.fileobj.close()
    print(json.dumps({"opened": opened, "failed": failed}), flush=True)


class Trickler:
    def __init__(self, port: int, head: bytes, drip: bytes):
        self.drip = drip
        self.started_s = time.monotonic()
        self.closed_s: float | None = None
        try:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=2)
            self.sock.sendall(head)
            self.sock.setblocking(False)
        except OSError:
            self.closed_s = self.started_s

    def tick(self) -> None:
        if self.closed_s is not None:
            return
        try:
            while self.sock.recv(65536):
                pass
            self.closed_s = time.monotonic()
        except BlockingIOError:
            try:
                self.sock.send(self.drip)
            except OSError:
                self.closed_s = time.monotonic()
        except OSError:
            self.closed_s = time.monotonic()
        if self.closed_s is not None:
            self.sock.close()


def health(port: int, timeout_s: float = 2.0) -> float | None:
    """Seconds /health took to answer 200, or None."""
    start_s = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
    except OSError:
        return None
    return time.monotonic() - start_s if reply.startswith(b"HTTP/1.1 200") else None


class Sampler(threading.Thread):
    """Polls /health every second and samples the server's descriptors and RSS."""

    def __init__(self, port: int, pid: int):
        super().__init__(daemon=True)
        self.port, self.proc = port, psutil.Process(pid)
        self.stop, self.phase = threading.Event(), "trickle"
        self.polls: dict[str, list[float | None]] = {}
        self.peak_fds = self.peak_rss = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.polls.setdefault(self.phase, []).append(health(self.port))
            try:
                self.peak_fds = max(self.peak_fds, self.proc.num_fds())
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
            except psutil.Error:
                pass
            self.stop.wait(1.0)


def run_one(kind: str, *, trickle_s: float, header_tricklers: int, body_tricklers: int, flood: int,
            flood_s: float, settle_s: float) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_fd, log_name = tempfile.mkstemp(prefix=f"serve-{kind}-", suffix=".log")
    server = subprocess.Popen([sys.executable, __file__, "--serve-child", kind, "--port", str(port)],
                              stdout=log_fd, stderr=subprocess.STDOUT)
    os.close(log_fd)  # the child has its own copy
    try:
        deadline_s = time.monotonic() + 120
        while health(port) is None:
            if time.monotonic() > deadline_s or server.poll() is not None:
                raise RuntimeError(f"the {kind} server did not start; see {log_name}")
            time.sleep(0.2)
        proc = psutil.Process(server.pid)
        start = {"fds": proc.num_fds(), "rss_mb": proc.memory_info().rss / 2**20}
        sampler = Sampler(port, server.pid)
        sampler.start()

        headers = [Trickler(port, PARTIAL_HEADERS, b"X-a: b\r\n") for _ in range(header_tricklers)]
        bodies = [Trickler(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n", b"{")
                  for _ in range(body_tricklers)]
        end_s, tick = time.monotonic() + trickle_s, 0
        while time.monotonic() < end_s:
            for b in bodies:
                b.tick()
            if tick % 2 == 0:
                for h in headers:
                    h.tick()
            tick += 1
            time.sleep(1.0)

        def closed_after(ts: list[Trickler]) -> dict:
            times = [t.closed_s - t.started_s for t in ts if t.closed_s is not None]
            return {"closed": len(times), "of": len(ts),
                    "median_s": round(statistics.median(times), 1) if times else None,
                    "max_s": round(max(times), 1) if times else None}

        tricklers = {"headers": closed_after(headers), "bodies": closed_after(bodies)}

        sampler.phase = "flood"  # the tricklers still open stay so
        floods = [subprocess.Popen([sys.executable, __file__, "--flood-child", "--port", str(port),
                                    "--flood", str(flood // 2), "--flood-s", str(flood_s)],
                                   stdout=subprocess.PIPE, text=True) for _ in range(2)]
        flooded = [json.loads(f.communicate(timeout=flood_s + 120)[0] or "{}") for f in floods]
        for t in headers + bodies:
            if t.closed_s is None:
                t.sock.close()
        sampler.phase = "after"
        time.sleep(settle_s)
        sampler.stop.set()
        sampler.join()
        after = {"fds": proc.num_fds(), "rss_mb": proc.memory_info().rss / 2**20}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    log_text = Path(log_name).read_bytes()
    os.unlink(log_name)

    def answered(polls: list[float | None]) -> str:
        ok = [p for p in polls if p is not None]
        worst = f", worst {max(ok):.2f} s" if ok else ""
        return f"{len(ok)}/{len(polls)}{worst}"

    return {
        "server": kind,
        "tricklers": tricklers,
        "flood": {
            "opened": sum(f.get("opened", 0) for f in flooded),
            "failed": sum(f.get("failed", 0) for f in flooded),
        },
        "health": {phase: answered(polls) for phase, polls in sampler.polls.items()},
        "fds": {"start": start["fds"], "peak": sampler.peak_fds, "after": after["fds"]},
        "rss_mb": {
            "start": round(start["rss_mb"], 1),
            "peak": round(sampler.peak_rss / 2**20, 1),
            "after": round(after["rss_mb"], 1),
        },
        "log": {
            "lines": log_text.count(b"\n"),
            "bytes": len(log_text),
            "too_many_open_files": log_text.count(b"Too many open files"),
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", nargs="+", default=["plain", "guarded"], choices=["plain", "guarded"])
    p.add_argument("--trickle-s", type=float, default=30.0, help="seconds the tricklers keep at it")
    p.add_argument("--header-tricklers", type=int, default=600)
    p.add_argument("--body-tricklers", type=int, default=50)
    p.add_argument("--flood", type=int, default=20400, help="connections the two flood clients hold at most")
    p.add_argument("--flood-s", type=float, default=45.0)
    p.add_argument("--settle-s", type=float, default=10.0, help="quiet seconds before the 'after' sample")
    p.add_argument("--serve-child", help=argparse.SUPPRESS)
    p.add_argument("--flood-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_child:
        serve_child(args.serve_child, args.port)
        return
    if args.flood_child:
        flood_child(args.port, args.flood, args.flood_s)
        return
    import resource

    print(f"open-file limit (soft, hard): {resource.getrlimit(resource.RLIMIT_NOFILE)}", flush=True)
    for kind in args.server:
        result = run_one(kind, trickle_s=args.trickle_s, header_tricklers=args.header_tricklers,
                         body_tricklers=args.body_tricklers, flood=args.flood, flood_s=args.flood_s,
                         settle_s=args.settle_s)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
