"""`pdserve serve` on a port something already listens on exits at once, naming the port and the
flag to change, before any Ray process starts (it used to fail 25 s later with the cause only in
Ray's log files)."""

from __future__ import annotations

import socket
import time

import pytest

from deploy.cli import main


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_serve_on_a_busy_port_exits_at_once_naming_it(flag, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    with socket.socket() as busy, socket.socket() as free:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        free.bind(("127.0.0.1", 0))
        busy_port, free_port = busy.getsockname()[1], free.getsockname()[1]
        free.close()  # NOTE: a port nobody listens on
        ports = {"--port": free_port, "--grpc-port": free_port}
        ports[flag] = busy_port
        started = time.monotonic()
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--port", str(ports["--port"]), "--grpc-port", str(ports["--grpc-port"]),
                  "--exit-after", "0"])
    assert time.monotonic() - started < 5
    message = str(exited.value)
    assert f"127.0.0.1:{busy_port} is in use" in message and f"pass {flag} with a free port" in message


def test_status_without_a_cluster_says_so_in_one_line(monkeypatch, capsys):
    import ray

    def no_cluster(*_, **__):  # what ray.init raises when it finds no cluster (Ray 2.60)
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "init", no_cluster)
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pdserve status: no Ray cluster runs at --address auto") and "Traceback" not in err
