"""Scale-out on one machine: N ``tfgraph serve`` replicas behind haproxy on 127.0.0.1.

``tfgraph serve DIR --replicas N`` runs this. Each replica is a ``tfgraph serve`` process of its
own (its own ONNX Runtime session, in-flight batcher and ``--threads`` share of the cores) on a
loopback port; haproxy, the load balancer from the Debian packages (``apt-get install
haproxy``; tfgraph neither downloads nor bundles it), listens on the public port and spreads
requests over the replicas that pass its health check (``GET /health``), fewest open
connections first (``leastconn``).

What the generated configuration (:func:`haproxy_config`) promises, and why:

- **A stream stays on its replica.** A streamed completion is one HTTP request on one
  connection; haproxy balances requests, so every token of a stream comes from the replica
  that prefilled it (its KV cache lives there and nowhere else).
- **A retry only where it is safe**: ``retry-on conn-failure empty-response`` with
  ``option redispatch``: a request is sent again, to another replica, only when the connection
  failed or the replica closed it before a single byte of its answer. Then the client has seen
  nothing and a rerun of the generation is indistinguishable from the first try (greedy or
  seeded: the same tokens). Once the response has started (a stream's headers, its first
  token) it is never retried: the client already holds part of one generation, and a second
  one would not continue it. ``option http-buffer-request`` (the whole body read before a
  replica is picked) is needed for those retries: without it haproxy 2.6.12 retried nothing
  here (measured: a non-streamed request whose replica was SIGKILLed got a 502, ``SH--``,
  0 retries; with it, a 200 from the other replica).
- **Tokens as they come**: ``option http-no-delay``. A token stream is the interactive
  payload haproxy's default delays to send full packets: measured here through haproxy
  without it, the first token came at a median 207 ms and the rest in bursts ~200 ms apart;
  with it, 31 ms and a token every ~20 ms, as from the replica directly (27 ms, 20 ms).
- **A dead replica is taken out** by the health check (every ``CHECK_INTERVAL_MS``, down after
  ``FALL`` failures) and at once by ``observe layer4`` (a refused connection on live traffic
  marks it down). Its in-flight streams end as a truncated response: the client sees an error,
  never a hang. Each answer carries ``X-Tfgraph-Replica`` (``r0``, ``r1``…): who served it.

:class:`ReplicaSet` starts the replicas, waits until each answers ``/health`` (progress through
:mod:`tfgraph.progress`), starts haproxy in the foreground (``-db``) and always stops all of them
on exit (each child also gets SIGTERM if this process dies: ``PR_SET_PDEATHSIG``). It writes
nothing but the configuration file, which it keeps: it is the user's to reuse.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tfgraph import progress
from tfgraph.errors import TfgraphError

logger = logging.getLogger(__name__)

BALANCERS = ("haproxy",)
HEALTH_PATH = "/health"
REPLICA_HEADER = "X-Tfgraph-Replica"  # the replica that answered: r0, r1, …
_SBIN = ("/usr/sbin", "/sbin")  # haproxy's home, not on a Debian user's PATH
CHECK_INTERVAL_MS = 500
FALL = 2  # failed checks before a replica is marked down
RISE = 2  # passed checks before it is back
_STOP_WAIT_S = 10.0  # a replica's graceful shutdown (uvicorn's own is 5 s) before SIGKILL


def find_balancer(name: str = "haproxy") -> str:
    """The path of the load balancer ``name`` on ``PATH`` (``/usr/sbin`` included), or a
    one-line error saying how to install it."""
    if name not in BALANCERS:
        raise TfgraphError(f"unknown balancer '{name}': tfgraph runs {', '.join(BALANCERS)}")
    path = os.environ.get("PATH", os.defpath)
    found = shutil.which(name, path=os.pathsep.join([path, *_SBIN]))
    if found is None:
        raise TfgraphError(
            f"{name} is not installed (not on PATH): install it from your distribution, "
            f"e.g. 'apt-get install {name}' on Debian/Ubuntu"
        )
    return found


def haproxy_config(
    public: tuple[str, int], replicas: list[tuple[str, int]], *, health: str = HEALTH_PATH
) -> str:
    """haproxy's configuration: ``public`` (host, port) in front of ``replicas``."""
    if not replicas:
        raise TfgraphError("no replicas to balance: give --replicas 1 or more")
    host, port = public
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    servers = [
        f"    server r{i} {f'[{h}]' if ':' in h else h}:{p}" for i, (h, p) in enumerate(replicas)
    ]
    return "\n".join(
        [
            "# tfgraph serve --replicas: haproxy in front of tfgraph serve replicas",
            "# run it yourself: haproxy -db -f THIS_FILE (start the replicas first)",
            "global",
            "    maxconn 4096",
            "",
            "defaults",
            "    mode http",
            "    timeout connect 2s",
            "    timeout client 10m  # a long non-streamed generation",
            "    timeout server 10m",
            "    timeout http-keep-alive 10s",
            "    timeout queue 60s",
            "    # retried only when the replica got no connection or closed it before a byte",
            "    # of its answer: the client saw nothing, so a rerun elsewhere is safe;",
            "    # a started response (a stream's headers, its tokens) is never retried",
            "    retries 2",
            "    option redispatch 1",
            "    retry-on conn-failure empty-response",
            "    option http-buffer-request  # the whole body first: else no retry (measured)",
            "    # tokens as they come: without it haproxy held SSE chunks to fill packets,",
            "    # 207 ms to the first token instead of 31 ms (direct: 27 ms), measured",
            "    option http-no-delay",
            "",
            "frontend tfgraph",
            f"    bind {bind}",
            "    default_backend replicas",
            "",
            "backend replicas",
            "    balance leastconn  # a stream holds its connection: count streams",
            f"    http-response set-header {REPLICA_HEADER} %s  # which replica answered",
            f"    option httpchk GET {health}",
            "    http-check expect status 200",
            f"    default-server check inter {CHECK_INTERVAL_MS}ms fall {FALL} rise {RISE} "
            "observe layer4 error-limit 1 on-error mark-down",
            *servers,
            "",
        ]
    )


def check_config(balancer: str, config: Path) -> None:
    """``haproxy -c``: the configuration parses, or a one-line error with haproxy's words."""
    done = subprocess.run(
        [balancer, "-c", "-q", "-f", str(config)], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split())[:400]
        raise TfgraphError(f"haproxy refused the configuration {config}: {said}")


def replica_threads(replicas: int, threads: int | None = None) -> int:
    """Intra-op threads of each replica: ``threads`` if given, else the cores shared out."""
    if threads is not None:
        return threads
    return max(1, (os.cpu_count() or 1) // replicas)


def plan_ports(host: str, port: int, replicas: int) -> tuple[int, list[int]]:
    """(public port, the replicas' ports): ``port`` and the ``replicas`` ports after it, or, for
    port 0, free ports. Each must be free now, or a one-line error naming it."""
    if replicas < 1:
        raise TfgraphError(f"--replicas {replicas}: give 1 or more")
    if port == 0:
        socks = [_bind(host, 0) for _ in range(replicas + 1)]
        ports = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        return ports[0], ports[1:]
    ports = list(range(port, port + replicas + 1))
    if ports[-1] > 65535:
        raise TfgraphError(f"ports {port}..{ports[-1]}: past 65535; choose a lower --port")
    for p in ports:
        _bind(host, p).close()
    return ports[0], ports[1:]


def _bind(host: str, port: int) -> socket.socket:
    from tfgraph.runtime.serving.openai_app import bound_socket

    return bound_socket(host, port)


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when this process dies (Linux), and SIGINT as a terminal
    would deliver it (not inherited as ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: close() still stops the children
        pass


@dataclass
class Replica:
    index: int
    host: str
    port: int
    process: subprocess.Popen | None = None
    ended: float | None = None  # when the supervisor saw it gone (monotonic)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclass
class ReplicaSet:
    """N replicas of ``artifact`` behind haproxy on ``host:port``; a context manager.

    ``serve_args``: the ``tfgraph serve`` flags every replica gets (``--max-batch 8`` …);
    ``config``: where the haproxy configuration goes (kept after exit). ``events`` collects
    haproxy's own lines (a server going DOWN, with when it was read) for whoever measures."""

    artifact: Path
    replicas: int
    host: str = "127.0.0.1"
    port: int = 8000
    threads: int | None = None
    serve_args: list[str] = field(default_factory=list)
    config: Path | None = None
    balancer: str = "haproxy"
    ready_timeout_s: float = 600.0
    members: list[Replica] = field(default_factory=list, init=False)
    events: list[tuple[float, str]] = field(default_factory=list, init=False)
    public_port: int = field(default=0, init=False)
    _haproxy: subprocess.Popen | None = field(default=None, init=False)
    _reader: threading.Thread | None = field(default=None, init=False)

    def __enter__(self) -> ReplicaSet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.public_port}"

    def start(self) -> None:
        """Check, write the configuration, start the replicas, wait for them, start haproxy."""
        binary = find_balancer(self.balancer)
        if not Path(self.artifact).is_dir():
            raise TfgraphError(
                f"'{self.artifact}' is not a directory: give an artifact (tfgraph export's)"
            )
        self.public_port, ports = plan_ports(self.host, self.port, self.replicas)
        self.members = [Replica(i, self.host, p) for i, p in enumerate(ports)]
        text = haproxy_config(
            (self.host, self.public_port), [(m.host, m.port) for m in self.members]
        )
        self.config = Path(self.config or f"haproxy-tfgraph-{self.public_port}.cfg").resolve()
        self.config.write_text(text)
        check_config(binary, self.config)
        with progress.stage(f"{self.replicas} replicas loading"):
            for member in self.members:
                member.process = self._spawn_replica(member)
            self._wait_ready()
        with progress.stage("haproxy starting"):
            self._haproxy = subprocess.Popen(
                [binary, "-db", "-f", str(self.config)], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip
            self._reader = threading.Thread(target=self._read_haproxy, daemon=True)
            self._reader.start()
            _wait_health(self.url, lambda: self._haproxy.poll(), 30.0, "haproxy")

    def _spawn_replica(self, member: Replica) -> subprocess.Popen:
        threads = replica_threads(self.replicas, self.threads)
        cmd = [sys.executable, "-m", "tfgraph", "serve", str(self.artifact), "--host", member.host,
               "--port", str(member.port), "--threads", str(threads), *self.serve_args]  # fmt: skip
        logger.info("replica %d: %s", member.index, " ".join(cmd))
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip  # stderr: the terminal's (a replica that fails says why there)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        pending = list(self.members)
        while pending:
            for member in list(pending):
                code = member.process.poll()
                if code is not None:
                    raise TfgraphError(
                        f"replica {member.index} (port {member.port}) exited with {code} "
                        "while loading: its error is above"
                    )
                if _healthy(member.url):
                    pending.remove(member)
                    progress.tick("replicas ready", self.replicas - len(pending), self.replicas)
            if pending and time.monotonic() > deadline:
                raise TfgraphError(
                    f"{len(pending)} replicas not ready after {self.ready_timeout_s:.0f} s"
                )
            time.sleep(0.2)

    def _read_haproxy(self) -> None:
        for line in self._haproxy.stdout:
            line = line.rstrip()
            if line:
                self.events.append((time.monotonic(), line))
                logger.warning("haproxy: %s", line)

    def alive(self) -> list[Replica]:
        return [m for m in self.members if m.process and m.process.poll() is None]

    def supervise(self, poll_s: float = 0.5) -> None:
        """Until interrupted: log each replica that ends; return an error when none is left
        or haproxy itself ended. (In a cluster a Deployment would restart it; here it stays
        down and haproxy serves from the others.)"""
        while True:
            for member in self.members:
                code = member.process.poll() if member.process else None
                if code is not None and member.ended is None:
                    member.ended = time.monotonic()
                    logger.warning(
                        "replica %d (port %d) ended with %s: haproxy takes it out; %d of %d left",
                        member.index, member.port, code, len(self.alive()), self.replicas,
                    )  # fmt: skip
            if not self.alive():
                raise TfgraphError("every replica has ended: nothing left to serve")
            if self._haproxy is not None and self._haproxy.poll() is not None:
                raise TfgraphError(f"haproxy ended with {self._haproxy.returncode}")
            time.sleep(poll_s)

    def close(self) -> None:
        """Stop haproxy, then every replica (SIGTERM, then SIGKILL after a grace period)."""
        children = [self._haproxy] + [m.process for m in self.members]
        for child in children:
            if child is not None and child.poll() is None:
                _signal(child, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_WAIT_S
        for child in children:
            if child is None:
                continue
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(child, signal.SIGKILL)
                child.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=5)  # haproxy ended: its output ends
        if self._haproxy is not None and self._haproxy.stdout is not None:
            self._haproxy.stdout.close()


def _signal(child: subprocess.Popen, signum: int) -> None:
    """``signum`` to the child's process group (its own: ``start_new_session``)."""
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass


def _healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + HEALTH_PATH, timeout=timeout) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _wait_health(url: str, ended, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if ended() is not None:
            raise TfgraphError(f"{what} exited while starting: its error is above")
        if time.monotonic() > deadline:
            raise TfgraphError(f"{what} did not answer {url}{HEALTH_PATH} in {timeout_s:.0f} s")
        time.sleep(0.1)
