"""Start, probe and stop an SGLang server for one benchmark arm (stdlib HTTP; sglang runs in the child only).

A fresh server per arm keeps arms independent (different workers, caches and cumulative counters). The child
gets its own session so stopping it also stops its scheduler/detokenizer children, and only those.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


class ServerError(RuntimeError):
    """The server exited or did not become healthy; the message carries the tail of its log."""


def free_port() -> int:
    """A free TCP port for a server to listen on (`free_ports`)."""
    return free_ports(1)[0]


def free_ports(n: int, offsets: tuple[int, ...] = (0,)) -> list[int]:
    """n distinct ports p, each free at p + every offset, below the kernel's ephemeral port range.

    Why below it: a port from the range (what binding port 0 hands out) can become the local port of any outgoing
    connection on the machine between this choice and the server's bind; on a busy machine that happens (a CPU server
    died at start-up with "[Errno 98] address already in use"). offsets: ports the server derives from p and binds
    too (SGLang's DP-attention Engines bind ZMQ sockets at p + 233 ..). The chosen ports are held open while the
    others are chosen, so no two coincide."""
    top = ephemeral_low() - max(offsets) - 1
    rng, socks, ports = random.SystemRandom(), [], []
    try:
        for _ in range(100 * n):
            if len(ports) == n:
                return ports
            base = rng.randrange(10000, top)
            held = [sock for sock in (_bound(base + off) for off in offsets) if sock is not None]
            socks += held
            if len(held) == len(offsets):
                ports.append(base)
        raise ServerError(f"no {n} free ports in 10000..{top} (each free at +{offsets})")
    finally:
        for sock in socks:
            sock.close()


def _bound(port: int) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range; else the
    IANA range's 49152)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def http_json(url: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
    """GET (payload None) or POST JSON; returns the decoded body ({} for an empty one)."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body.strip() else {}


def flush_cache(url: str, timeout: float = 120.0) -> None:
    """Empty the server's prefix cache. SGLang answers 400 while requests are still in flight (e.g. a just-finished
    warmup being torn down), so retry until it succeeds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"), timeout=30).read()
            return
        except urllib.error.HTTPError as e:
            if e.code != 400 or time.monotonic() > deadline:
                raise
            time.sleep(1)


SGLANG = "sglang.launch_server"  # a server: `Server` adds --sleep-on-idle
ROUTER = "sglang_router.launch_router"  # PyPI sglang-router: the load balancer in front of SGLang servers


def await_router_workers(url: str, params: dict, timeout: float = 120.0) -> None:
    """sglang-router answers /health before it has registered its workers, and 503 to requests until then: wait for
    a request (sampling `params`) to go through."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            http_json(url + "/generate", {"input_ids": [1, 2], "sampling_params": params})
            return
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(1)


class Server:
    """`with Server(argv, env, log) as s:` runs `python -m sglang.launch_server argv` until the block exits;
    `module=ROUTER` runs sglang-router instead (argv: e.g. `--worker-urls URL URL --policy round_robin`)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, startup_timeout: float = 900.0,
                 python: str | None = None, module: str = SGLANG) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # python: another interpreter (e.g. a virtualenv with another SGLang version); default this one.
        # --sleep-on-idle: an idle SGLang scheduler otherwise spins a core (its idle checks in a loop), taken from
        # whatever runs beside it (the other server of a PD pair, a client, another test)
        idle = ["--sleep-on-idle"] if module == SGLANG and "--sleep-on-idle" not in argv else []
        self.argv = [python or sys.executable, "-m", module, *argv, *idle, "--host", "127.0.0.1", "--port",
                     str(self.port)]
        self.env = {**os.environ, **env}
        self.log = Path(log)
        self.timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def start(self) -> None:
        """Launch without waiting (several servers can start side by side; `stop` them all in any case)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._started = time.monotonic()

    def wait_ready(self) -> Server:
        """Block until /health answers (startup_timeout from `start`); ServerError if the server exits first. A server
        started long ago (beside other work) is asked at least once, however late."""
        deadline = self._started + self.timeout
        while True:
            if self.proc.poll() is not None:
                self._close()
                raise ServerError(f"server exited with status {self.proc.returncode}:\n{self.tail()}")
            try:  # (any 200: SGLang answers an empty body, sglang-router a text one)
                urllib.request.urlopen(self.url + "/health", timeout=5).read()
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                if time.monotonic() >= deadline:
                    break
                time.sleep(2)
        self.stop()
        raise ServerError(f"server not healthy after {self.timeout:.0f}s:\n{self.tail()}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def info(self) -> dict:
        return http_json(self.url + "/server_info", timeout=30)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM to the server alone, which shuts its schedulers down itself (~3 s on CPU; a SIGTERM to its whole
        session kills a scheduler first, which the server takes for a crash: it logs one and waits 5 s before its
        cleanup), then SIGKILL to whatever is left of the session this class created for it."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # (nothing left)
                pass
            self.proc.wait(timeout=30)
        self._close()

    def _close(self) -> None:
        f = getattr(self, "_log_file", None)
        if f is not None and not f.closed:
            f.close()
