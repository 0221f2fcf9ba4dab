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


def test_serve_whose_app_fails_to_start_exits_with_the_deployments_error(monkeypatch):
    """Serve says only which deployment failed; the replica's own error (a worker's CUDA out of memory on a
    GPU machine) was in Ray's session logs only. Now the exit message carries it."""
    from types import SimpleNamespace

    import ray
    from ray import serve

    monkeypatch.setattr(ray, "init", lambda *a, **k: SimpleNamespace(address_info={"gcs_address": "x:1"}))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(serve, "start", lambda *a, **k: None)

    def failing_run(*args, **kwargs):
        raise RuntimeError("Deploying application pdserve failed: Failed to update the deployments ['Controller'].")

    monkeypatch.setattr(serve, "run", failing_run)
    deployments = {"Controller": SimpleNamespace(status="DEPLOY_FAILED", message="torch.OutOfMemoryError: CUDA out"),
                   "Router": SimpleNamespace(status="HEALTHY", message="")}
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(
        applications={"pdserve": SimpleNamespace(status="DEPLOY_FAILED", message="", deployments=deployments)}))
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ports = [str(a.getsockname()[1]), str(b.getsockname()[1])]
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", ports[0], "--grpc-port", ports[1], "--exit-after", "0"])
    message = str(exited.value)
    assert "the application failed to start" in message and "['Controller']" in message
    assert "Controller: DEPLOY_FAILED: torch.OutOfMemoryError: CUDA out" in message and "Router" not in message.split(
        "\n", 1)[1]
