"""A `pdserve serve` subprocess for the lab's drivers (bench.goodput, bench.http_vs_offline,
bench.ray_path_ttft): started in its own process group, waited for, stopped by SIGINT, SIGTERM, SIGKILL
and then whatever of its group remains (Ray's processes); the tails and errors of Ray's logs; and a wait
until the GPUs' memory is free again."""

from __future__ import annotations

import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the server runs from the repository's root
ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception)(?:\([\w.]+\))?: .*$", re.MULTILINE)
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours actor names in its logs


class ServerError(RuntimeError):
    """The server could not start, died, or did not answer in time."""


class PortTakenError(ServerError):
    """Another process answered on the server's port (Ray's own gRPC servers bind random free ports)."""


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group PGID, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


class ServerProcess:
    """`python -m deploy.cli serve ...` in a session of its own, its output into LOG_PATH."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.started = time.time()
        self.proc = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise ServerError(f"the server exited with code {code} (its log: {self.log_path.name})")

    def wait_ready(self, url: str, timeout_s: float) -> None:
        """Polls URL until it answers 200; raises ServerError if the server exits or TIMEOUT_S passes,
        PortTakenError if something that does not speak HTTP/1.1 answers there."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            except http.client.HTTPException as err:  # NOTE: an HTTP/2 (gRPC) server's frames, say
                raise PortTakenError(f"{url} answered in another protocol ({type(err).__name__}): another "
                                     "process holds the port") from err
            if time.monotonic() > deadline:
                raise ServerError(f"no answer from {url} within {timeout_s:.0f} s")
            time.sleep(1.0)

    def stop(self, timeout_s: float) -> str:
        """SIGINT (the CLI shuts Serve and Ray down), then SIGTERM, then SIGKILL; then SIGKILL for what is
        left of its process group (Ray's processes). Returns how it went."""
        code = self.proc.poll()
        if code is not None:
            how = f"had exited with code {code}"
        else:
            how = ""
            for sig, wait_s in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                started = time.monotonic()
                self.proc.send_signal(sig)
                try:
                    code = self.proc.wait(wait_s)
                except subprocess.TimeoutExpired:
                    continue
                how = f"stopped by {sig.name} in {time.monotonic() - started:.1f} s (exit code {code})"
                break
            how = how or "did not exit even after SIGKILL"
        deadline = time.monotonic() + 10.0
        while (left := _group_members(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        if left:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            how += f"; {len(left)} leftover process(es) of its group killed"
        self._log.close()
        return how


RAY_ADDRESS_LINE = re.compile(r"^\s*Ray\s+(\S+:\d+)\b", re.MULTILINE)  # `pdserve serve`'s "Ray  host:port" line


def cluster_status(log_path: Path, env: dict[str, str], timeout_s: float = 60.0,
                   trace: Path | None = None) -> list[str]:
    """`pdserve status` of the server whose log is LOG_PATH (the Ray address it printed): every
    worker of every pool, draining ones included, and the autoscaler's last decisions; or why not.
    trace: where `pdserve status --trace` writes the autoscaler's readings (None: not asked)."""
    found = RAY_ADDRESS_LINE.search(log_path.read_text(errors="replace"))
    if found is None:
        return ["no status: the server's log names no Ray address"]
    argv = [sys.executable, "-m", "deploy.cli", "status", "--address", found.group(1)]
    try:
        done = subprocess.run([*argv, *(("--trace", str(trace)) if trace is not None else ())], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [f"no status: `pdserve status` took over {timeout_s:.0f} s"]
    return (done.stdout + done.stderr).splitlines()


def ray_session_dir(server_pid: int) -> Path | None:
    """The Ray session whose driver was SERVER_PID (its logs/python-core-driver-*_<pid>.log)."""
    root = Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray"
    sessions = sorted(root.glob("session_2*"), key=lambda p: p.stat().st_mtime, reverse=True)[:8]
    for session in sessions:
        if any((session / "logs").glob(f"python-core-driver-*_{server_pid}.log")):
            return session
    return None


# Serve's access log of each call to a replica (the routers poll the controller every second): it would
# fill a tail and push out the controller's and workers' warnings
SERVE_ACCESS_LINE = re.compile(r" -- CALL \S+ OK [\d.]+ms$")


def ray_log_tails(session: Path, num_lines: int = 60, max_files: int = 14) -> str:
    """The last lines of Ray's logs that say most (workers' stderr/stdout, Serve's), errors first."""
    logs = session / "logs"
    files = [p for pattern in ("worker-*.err", "worker-*.out", "serve/*.log", "raylet.err", "gcs_server.err")
             for p in logs.glob(pattern) if p.stat().st_size > 0]

    def rank(p: Path) -> tuple[int, float]:
        text = p.read_bytes()[-200_000:]
        return (0 if b"Traceback" in text or b"Error" in text else 1, -p.stat().st_mtime)

    parts = []
    for path in sorted(files, key=rank)[:max_files]:
        lines = [line for line in path.read_text(errors="replace").splitlines()
                 if not SERVE_ACCESS_LINE.search(line)][-num_lines:]
        parts.append(f"---- {path.relative_to(logs)} (last {len(lines)} lines)\n" + "\n".join(lines))
    return "\n".join(parts)


def error_lines(text: str, limit: int = 8) -> list[str]:
    """The distinct 'SomeError: message' lines of TEXT (the last lines of tracebacks), in order, at most LIMIT."""
    found = dict.fromkeys(m.group(0)[:300] for m in ERROR_LINE.finditer(ANSI_ESCAPE.sub("", text)))
    return list(found)[:limit]


def wait_gpus_free(timeout_s: float, max_used_fraction: float = 0.05) -> str:
    """Waits until nvidia-smi lists no compute process and every GPU has at most MAX_USED_FRACTION of its
    memory in use (the last mode's workers are gone; a container may hide their pids, never their memory).
    Only the GPUs of CUDA_VISIBLE_DEVICES count where it is set: two benches may share a machine on
    disjoint GPUs."""
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi"
    deadline = time.monotonic() + timeout_s
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    only = ["-i", visible] if visible else []

    def query(*args: str) -> str:
        return subprocess.run(["nvidia-smi", *only, *args, "--format=csv,noheader,nounits"], check=False,
                              capture_output=True, text=True, timeout=20).stdout.strip()

    while True:
        apps = query("--query-compute-apps=pid")
        memory = [tuple(float(x) for x in line.split(",")) for line in query("--query-gpu=memory.used,memory.total")
                  .splitlines() if line.strip()]
        is_free = not apps and all(used <= max_used_fraction * total for used, total in memory)
        shown = ", ".join(f"{used / 1024:.1f}/{total / 1024:.0f} GiB" for used, total in memory)
        if is_free:
            return f"GPUs free ({shown})"
        if time.monotonic() > deadline:
            return f"GPUs still busy after {timeout_s:.0f} s ({shown}; processes: {apps or 'none listed'})"
        time.sleep(1.0)


def scrape_metrics(base_url: str, timeout_s: float = 10.0) -> str:
    """The /metrics page of the server at BASE_URL (scheme://host:port, no /v1)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as reply:  # noqa: S310 - a local server
        return reply.read().decode()
