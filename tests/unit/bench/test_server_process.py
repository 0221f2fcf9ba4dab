from bench.server_process import ray_log_tails


def test_a_log_tail_leaves_out_serve_s_access_lines_so_the_controller_s_warnings_stay_in_it(tmp_path):
    serve_logs = tmp_path / "logs" / "serve"
    serve_logs.mkdir(parents=True)
    access = [f"INFO 2026-11-27 11:57:{i:02d},000 pdserve_Controller do8 abc-{i} -- CALL workers OK 1.{i}ms"
              for i in range(50)]
    warning = "WARNING 2026-11-27 11:56:40,000 pdserve_Controller do8 -- autoscaler: prefill -> 0 workers (why)"
    (serve_logs / "replica_pdserve_Controller_do8.log").write_text("\n".join([warning, *access]) + "\n")
    tail = ray_log_tails(tmp_path, num_lines=5)
    assert warning in tail
    assert "CALL workers OK" not in tail


def test_cluster_status_finds_the_ray_address_the_server_printed(tmp_path) -> None:
    """The address `pdserve status` is given comes from the server's "Ray  host:port" line; a log
    without one says so instead of running anything."""
    from bench.server_process import RAY_ADDRESS_LINE, cluster_status

    log = ("pdserve: serving 'm' with 1 prefill + 1 decode worker(s), ready in 36.2 s\n"
           "  HTTP  http://127.0.0.1:37649/v1  (OpenAI API)\n"
           "  Ray   192.0.2.2:36125  (pdserve status --address ...)\n")
    assert RAY_ADDRESS_LINE.search(log).group(1) == "192.0.2.2:36125"
    empty = tmp_path / "server.log"
    empty.write_text("$ pdserve serve\n")
    assert cluster_status(empty, {}) == ["no status: the server's log names no Ray address"]
