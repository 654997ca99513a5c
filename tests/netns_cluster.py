"""Several "nodes" on one machine, for real: network and UTS namespaces made by the test.

Each node is a pair of namespaces (its own network stack and loopback, its own host name)
held open by a `sleep` process; a hub namespace holds a private bridge, and every node is
plugged into it by a veth pair with an address of a private range the harness picks
(10.213.0.0/24: nothing outside these namespaces ever sees it). Processes start inside a
node with `nsenter`, so a node's loopback, ports and host name are its own, as on a real
host; the root namespace of the machine is never changed. The test process reaches a port
inside a namespace through a relay (`Node.forward`): a loopback port in the root namespace
whose connections are made from a socket created inside the node.

    with Cluster(2, tmp_path) as cluster:
        agent = cluster.nodes[0].start("agent", [collector, "--config", cfg], env=env)
        ...
    # every process started in a node is killed, the relays closed, the namespaces gone

Teardown also runs on failure (a context manager), kills only processes inside the
cluster's own namespaces (found by their network namespace), and the holders die with the
test process (parent-death signal), so an interrupted test leaves no namespace behind.
`unavailable()` says why namespaces cannot be made here (not root), the one reason the
multi-node tests skip; a missing tool (`unshare`, `nsenter`, `setpriv`, `ip`) fails them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tests.services import ManagedProcess, MissingComponent, wait_for

T = TypeVar("T")

SUBNET = "10.213.0"
"""The bridge's /24 (private range); the hub is .1, node i is .(i + 2)."""
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, however it dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _run(argv: Sequence[str]) -> None:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")


def unavailable() -> str | None:
    """Why network + UTS namespaces with a bridge cannot be made here (no privilege), or None
    if they can. A missing tool is no reason to skip: it raises MissingComponent."""
    for tool in ("unshare", "nsenter", "setpriv", "ip"):
        if shutil.which(tool) is None:
            raise MissingComponent(f"`{tool}` is not installed (Debian: util-linux, iproute2)")
    probe = subprocess.run(
        ["unshare", "--net", "--uts", "--", "sh", "-c",
         "hostname otelprof-probe && ip link add probe0 type bridge"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if probe.returncode != 0:
        return (
            "cannot create network and UTS namespaces with a bridge here (needs root or "
            f"CAP_SYS_ADMIN + CAP_NET_ADMIN): {probe.stderr.strip()}"
        )
    return None


def _in_netns(pid: int, fn: Callable[[], T]) -> T:
    """`fn()` on a short-lived thread moved into `pid`'s network namespace: sockets it
    creates belong to that namespace for their whole life, whichever thread uses them."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns: {os.strerror(errno)}")
            finally:
                os.close(fd)
            out["value"] = fn()
        except BaseException as error:
            out["error"] = error

    thread = threading.Thread(target=run, name="otelprof-netns")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class Relay:
    """A loopback port of the root namespace relayed to `port` inside a node (for the test's
    own HTTP checks and for a Prometheus scraping a collector that runs inside a node)."""

    def __init__(self, node: Node, port: int, host: str = "127.0.0.1") -> None:
        self._node, self._target = node, (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, name="otelprof-relay", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = _in_netns(
                    self._node.pid, lambda: socket.create_connection(self._target, timeout=10)
                )
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@dataclass
class Node:
    """One simulated host: its namespaces' holder process, host name and bridge address."""

    hostname: str
    address: str
    holder: subprocess.Popen[bytes]
    workdir: Path
    processes: list[ManagedProcess] = field(default_factory=list)
    relays: list[Relay] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.holder.pid

    @property
    def netns(self) -> str:
        """The namespace's identity (`net:[inode]`), what its processes are found by."""
        return os.readlink(f"/proc/{self.pid}/ns/net")

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this node (setpriv and nsenter exec it: the pid is the
        command's, and it is killed if the test process dies before its teardown)."""
        return [
            "setpriv", "--pdeathsig", "KILL",
            "nsenter", f"--net=/proc/{self.pid}/ns/net", f"--uts=/proc/{self.pid}/ns/uts",
            "--", *argv,
        ]  # fmt: skip

    def sh(self, command: str) -> None:
        _run(self.argv(["sh", "-c", command]))

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        """A process inside this node, its output in `<workdir>/<name>.log`."""
        process = ManagedProcess(
            f"{name}@{self.hostname}",
            self.argv(argv),
            self.workdir / f"{name}.log",
            env=dict(env) if env is not None else None,
        )
        process.start()
        self.processes.append(process)
        return process

    def listening(self, port: int, host: str = "127.0.0.1") -> bool:
        """Whether something inside this node accepts connections on host:port."""

        def connect() -> bool:
            with socket.create_connection((host, port), timeout=2):
                return True

        try:
            return _in_netns(self.pid, connect)
        except OSError:
            return False

    def wait_listening(
        self, port: int, what: str, process: ManagedProcess, host: str = "127.0.0.1"
    ) -> None:
        def ready() -> bool:
            process.check_alive()
            return self.listening(port, host)

        wait_for(ready, timeout_s=120, what=f"{what} on {self.hostname}:{port}",
                 on_timeout=process.log_tail)  # fmt: skip

    def forward(self, port: int) -> int:
        """A root-namespace loopback port whose connections reach 127.0.0.1:port here."""
        relay = Relay(self, port)
        self.relays.append(relay)
        return relay.port

    def pids(self) -> list[int]:
        """Every process inside this node but its holder."""
        mine = self.netns
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.pid:
                continue
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/net") == mine:
                    found.append(int(entry))
        return found

    def kill_all(self) -> list[int]:
        """SIGKILL every process of this node (a node lost: no process gets to say goodbye);
        returns the pids killed."""
        killed = []
        for _ in range(5):  # a dying parent may start nothing new, but look again
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.2)
        for process in self.processes:
            if process.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.process.wait(timeout=10)
        return killed

    def close(self) -> None:
        for relay in self.relays:
            relay.close()
        self.kill_all()
        self.holder.kill()
        self.holder.wait(timeout=10)


def _holder(hostname: str) -> subprocess.Popen[bytes]:
    """A process that owns a new network and UTS namespace for as long as it sleeps."""
    holder = subprocess.Popen(
        ["unshare", "--net", "--uts", "--", "sh", "-c",
         f"hostname {hostname} && ip link set lo up && exec sleep infinity"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent, start_new_session=True,
    )  # fmt: skip

    def ready() -> bool:
        if holder.poll() is not None:
            raise RuntimeError(f"namespace holder exited: {holder.stderr.read()!r}")  # type: ignore[union-attr]
        return (
            os.readlink(f"/proc/{holder.pid}/ns/net") != os.readlink("/proc/self/ns/net")
            and subprocess.run(
                ["nsenter", f"--uts=/proc/{holder.pid}/ns/uts", "hostname"],
                capture_output=True, text=True,
            ).stdout.strip() == hostname
        )  # fmt: skip

    wait_for(ready, timeout_s=30, what=f"namespaces of {hostname}")
    return holder


class Cluster:
    """`n` nodes on a private bridge in a hub namespace; a context manager that tears
    everything down (also when the body fails). `hub` is a node too: services that all
    nodes reach (a gateway collector) run there at `hub.address`."""

    def __init__(self, n: int, workdir: Path, prefix: str = "otelprof-node") -> None:
        self.n, self.workdir, self.prefix = n, workdir, prefix
        self._hub: Node | None = None
        self.nodes: list[Node] = []

    @property
    def hub(self) -> Node:
        if self._hub is None:
            raise RuntimeError("the cluster is not built: use it as a context manager")
        return self._hub

    def __enter__(self) -> Cluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _build(self) -> None:
        self._hub = Node("otelprof-hub", f"{SUBNET}.1", _holder("otelprof-hub"),
                         self.workdir / "hub")  # fmt: skip
        self.hub.sh(
            f"ip link add br0 type bridge && ip addr add {SUBNET}.1/24 dev br0 "
            "&& ip link set br0 up"
        )
        for i in range(self.n):
            name = f"{self.prefix}{i}"
            node = Node(name, f"{SUBNET}.{i + 2}", _holder(name), self.workdir / name)
            self.nodes.append(node)
            self.hub.sh(
                f"ip link add veth{i} type veth peer name eth0 netns {node.pid} "
                f"&& ip link set veth{i} master br0 && ip link set veth{i} up"
            )
            node.sh(f"ip addr add {node.address}/24 dev eth0 && ip link set eth0 up")

    def close(self) -> None:
        for node in [*self.nodes, *([self._hub] if self._hub else [])]:
            with contextlib.suppress(Exception):
                node.close()


# -- a multi-node job and its telemetry path -------------------------------------------------

RDZV_PORT = 29400
AGENT_OTLP_PORT = 4317


def agent_config(gateway: str) -> dict[str, Any]:
    """A node's collector agent: OTLP from the node's own ranks on its loopback, forwarded to
    the gateway collector (`gateway` is host:port) with a queue and retries."""
    pipeline = {
        "receivers": ["otlp"],
        "processors": ["memory_limiter", "batch"],
        "exporters": ["otlp_grpc/gateway"],
    }
    return {
        "receivers": {
            "otlp": {"protocols": {"grpc": {"endpoint": f"127.0.0.1:{AGENT_OTLP_PORT}"}}}
        },
        "processors": {
            "memory_limiter": {
                "check_interval": "1s", "limit_percentage": 80, "spike_limit_percentage": 20,
            },
            "batch": {"timeout": "200ms"},
        },
        "exporters": {
            "otlp_grpc/gateway": {
                "endpoint": gateway,
                "tls": {"insecure": True},
                "sending_queue": {"enabled": True},
                "retry_on_failure": {"enabled": True},
            }
        },
        "service": {
            "telemetry": {"metrics": {"level": "none"}},
            "pipelines": {"traces": pipeline, "metrics": pipeline},
        },
    }  # fmt: skip


def torchrun_argv(
    cluster: Cluster, index: int, job: Sequence[str], rdzv_id: str | None
) -> list[str]:
    """Node `index`'s torchrun of a job over all nodes: c10d rendezvous hosted by node 0's
    launcher, 2 ranks per node, no restarts (a lost node fails the job)."""
    import sys

    node, first = cluster.nodes[index], cluster.nodes[0]
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={len(cluster.nodes)}", "--nproc-per-node=2", "--max-restarts=0",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={first.address}:{RDZV_PORT}",
        # which launcher serves the store, said outright: the heuristic resolves host names
        f"--rdzv-conf=is_host={int(index == 0)}", f"--local-addr={node.address}",
        *([f"--rdzv-id={rdzv_id}"] if rdzv_id else []),
        *job,
    ]  # fmt: skip


def job_env(**extra: str) -> dict[str, str]:
    """The test's environment without otelprof's or a launcher's variables, plus `extra`;
    gloo talks over the node's bridge interface."""
    from tests.services import REPO

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OTELPROF_", "OTEL_", "TORCHELASTIC_"))
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="eth0", **extra)
    return env


def ranks_printed(process: ManagedProcess) -> set[int]:
    """The global ranks a node's launcher ran, from what its workers printed (tests/ddp_job.py
    prints `rank R ...` once the process group exists): the truth otelprof is checked against."""
    import re

    text = process.log_path.read_text(errors="replace")
    return {int(m) for m in re.findall(r"^rank (\d+) ready", text, re.MULTILINE)}
