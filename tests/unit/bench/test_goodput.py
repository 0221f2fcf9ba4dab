"""bench/goodput.py and bench/goodput_report.py without servers: goodput and SLO attainment per rate
from known request timings, the best-goodput ratio and its goal, a failed mode recorded while the
other still runs, a server that dies at start, engine flags passed on unchanged, the time shares,
and the id-only tokenizer of config-only model shapes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest

from bench.goodput import (
    autoscaler_trace,
    id_only_tokenizer,
    mode_share,
    num_prompts,
    run_modes,
    servable_model_dir,
    serve_flags,
)
from bench.goodput_modes import mode_spec
from bench.goodput_report import ModeResult, compare, max_rate_within_slo, mode_summary, rate_row, table
from bench.server_process import ServerError, ServerProcess
from loadgen.metrics import SLO, compute_metrics
from loadgen.records import RequestRecord
from loadgen.report import RateRun

SLO_MS = SLO(ttft_ms=1000.0, tpot_ms=40.0)


def _plan(slo_ttft_ms: float, slo_tpot_ms: float):
    """A Plan whose server flags and SLOs a test reads (nothing is run)."""
    from bench.goodput import Plan

    return Plan(engine_flags=("--model", "m"), transport="nccl", model_name="m", vocab_size=10, is_cuda=True,
                rates=(1.0,), seconds_per_rate=1.0, drain_s=1.0, input_len=(1, 2), output_len=(1, 2),
                slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, min_attainment=0.5, num_warmup=1, seed=0,
                start_timeout_s=1.0, warmup_timeout_s=1.0, stop_timeout_s=1.0)

def record(i: int, ttft: float, tpot: float, num_tokens: int = 11, send: float = 0.0) -> RequestRecord:
    """A completed request sent at SEND whose first token came TTFT s later, then one every TPOT s."""
    chunks = tuple(send + ttft + k * tpot for k in range(num_tokens))
    return RequestRecord(i, num_tokens, send, chunks[-1], chunks, prompt_tokens=100, completion_tokens=num_tokens,
                         is_success=True, http_status=200)


def failed(i: int, send: float = 0.0) -> RequestRecord:
    return RequestRecord(i, 11, send, send + 1.0, http_status=503, error="no capacity")


def rate_run(rate: float, records: list[RequestRecord], duration_s: float, num_not_sent: int = 0) -> RateRun:
    return RateRun(rate, 0, num_not_sent, False, compute_metrics(records, duration_s, SLO_MS), records)


def mode(name: str, runs: list[RateRun], status: str = "ok") -> ModeResult:
    result = ModeResult(name, mode_spec(name).description, ["serve"], runs=runs)
    result.status = status
    return result


def test_goodput_counts_requests_meeting_both_slos_over_the_duration():
    records = [
        record(0, ttft=0.5, tpot=0.030),  # good
        record(1, ttft=1.2, tpot=0.030),  # TTFT over 1 s
        record(2, ttft=0.5, tpot=0.050),  # TPOT over 40 ms
        record(3, ttft=0.9, tpot=0.039),  # good
        failed(4),
    ]
    row = rate_row(rate_run(2.0, records, duration_s=10.0, num_not_sent=1))
    assert row["num_good"] == 2 and row["num_completed"] == 4 and row["num_errored"] == 1
    assert row["goodput"] == pytest.approx(2 / 10.0)
    assert row["num_planned"] == 6  # 5 sent + 1 not sent before the cap
    assert row["slo_attainment"] == pytest.approx(2 / 6)
    assert row["ttft_p90_ms"] == pytest.approx(1200 - 0.3 * 300, rel=1e-6)  # 0.5, 0.5, 0.9, 1.2 s: p90 interpolates
    assert row["itl_p99_ms"] == pytest.approx(50.0, rel=1e-6)


def test_best_rate_ratio_and_goal():
    good = [record(i, 0.2, 0.02) for i in range(8)]
    disagg = mode("disagg", [rate_run(1.0, good[:4], 4.0), rate_run(2.0, good, 4.0)])  # best 2.0 req/s at 2
    colocated = mode("colocated", [rate_run(1.0, good[:4], 4.0),
                                   rate_run(2.0, good[:2] + [record(9, 2.0, 0.1)] * 6, 4.0)])
    summaries = {"disagg": mode_summary(disagg), "colocated": mode_summary(colocated)}
    assert summaries["disagg"]["best"]["rate"] == 2.0 and summaries["colocated"]["best"]["rate"] == 1.0
    c = compare(summaries)
    assert c["ratio"] == pytest.approx(2.0 / 1.0) and c["is_goal_met"] and not c["is_partial"]
    assert [r["ratio"] for r in c["per_rate"]] == [pytest.approx(1.0), pytest.approx(4.0)]
    assert compare(summaries, goal=2.5)["is_goal_met"] is False
    assert "disagg / colocated best goodput = 2.00" in table(summaries, c)


def test_max_rate_within_slo_stops_at_the_first_rate_below_90_percent():
    rows = [{"rate": 1.0, "slo_attainment": 1.0}, {"rate": 2.0, "slo_attainment": 0.95},
            {"rate": 4.0, "slo_attainment": 0.5}, {"rate": 6.0, "slo_attainment": 0.92}]
    assert max_rate_within_slo(rows) == 2.0
    assert max_rate_within_slo([{"rate": 1.0, "slo_attainment": 0.2}]) is None


def test_a_failed_mode_gives_no_ratio_and_says_why():
    colocated = mode("colocated", [rate_run(1.0, [record(0, 0.2, 0.02)], 1.0)])
    disagg = mode("disagg", [], status="failed")
    disagg.phase, disagg.error = "warm-up", "ServerError: warm-up: 2 of 3 requests failed"
    c = compare({"disagg": mode_summary(disagg), "colocated": mode_summary(colocated)})
    assert c["ratio"] is None and c["is_goal_met"] is None
    assert "disagg" in c["reason"] and "warm-up" in c["reason"] and "2 of 3" in c["reason"]
    assert "not run" in compare({"disagg": mode_summary(colocated)})["reason"]


def test_a_mode_failing_mid_sweep_keeps_its_rates_and_marks_the_ratio_partial():
    good = [record(i, 0.2, 0.02) for i in range(4)]
    disagg = mode("disagg", [rate_run(1.0, good, 4.0)], status="failed")
    c = compare({"disagg": mode_summary(disagg),
                 "colocated": mode_summary(mode("colocated", [rate_run(1.0, good, 4.0)]))})
    assert c["ratio"] == pytest.approx(1.0) and c["is_partial"]


def test_colocated_without_any_good_request_gives_no_ratio():
    bad = [record(i, 5.0, 0.2) for i in range(3)]
    summaries = {"disagg": mode_summary(mode("disagg", [rate_run(1.0, bad, 3.0)])),
                 "colocated": mode_summary(mode("colocated", [rate_run(1.0, bad, 3.0)]))}
    c = compare(summaries)
    assert c["ratio"] is None and "colocated" in c["reason"]


def test_run_modes_records_a_failure_and_runs_the_next_mode():
    calls = []

    def run_one(name: str, deadline: float) -> ModeResult:
        calls.append((name, deadline))
        if name == "disagg":
            raise RuntimeError("driver bug")
        return mode(name, [])

    seen = []
    end = time.monotonic() + 100.0
    specs = {name: mode_spec(name) for name in ("disagg", "colocated")}
    results = run_modes(specs, run_one, end, on_result=lambda r: seen.append(dict(r)))
    assert [name for name, _ in calls] == ["disagg", "colocated"]
    assert results["disagg"].status == "failed" and "driver bug" in results["disagg"].error
    assert results["colocated"].status == "ok"
    assert len(seen) == 2 and list(seen[0]) == ["disagg"]  # the JSON is written after each mode
    assert calls[0][1] == pytest.approx(end - 50.0, abs=1.0)  # half the time for the first of two


def test_mode_share_and_prompt_counts():
    assert mode_share(0.0, 300.0, 2) == 150.0
    assert mode_share(100.0, 300.0, 1) == 300.0
    assert mode_share(400.0, 300.0, 2) == 400.0  # past the end: no time, never negative
    assert num_prompts(2.0, 24.0) == 48 and num_prompts(0.01, 10.0) == 1


def test_a_server_that_exits_at_start_fails_fast_with_its_log(tmp_path: Path):
    log = tmp_path / "server.log"
    server = ServerProcess([sys.executable, "-c", "print('boom: no GPU'); raise SystemExit(3)"], {}, log)
    started = time.monotonic()
    with pytest.raises(ServerError, match="exited with code 3"):
        server.wait_ready("http://127.0.0.1:9/v1/models", timeout_s=30.0)
    assert time.monotonic() - started < 10.0
    assert "exited with code 3" in server.stop(5.0)
    assert "boom: no GPU" in log.read_text()


def test_a_server_that_never_answers_is_stopped_by_sigint(tmp_path: Path):
    # NOTE: SIGINT's handler set first: a process started with SIGINT ignored (a background job of a
    # non-interactive shell, which its children inherit) would not hear it otherwise.
    code = ("import signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('clean exit')")
    server = ServerProcess([sys.executable, "-c", code], {}, tmp_path / "server.log")
    with pytest.raises(ServerError, match="no answer"):
        server.wait_ready("http://127.0.0.1:9/v1/models", timeout_s=1.0)
    assert "stopped by SIGINT" in server.stop(10.0)
    assert "clean exit" in (tmp_path / "server.log").read_text()


def test_a_port_answered_in_another_protocol_is_reported_as_taken(tmp_path: Path):
    # NOTE: what a 4x H200 run met: Ray's gRPC server (HTTP/2 frames) on the port the driver had picked
    import socket
    import threading

    from bench.server_process import PortTakenError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]

    def answer_in_frames() -> None:
        for _ in range(2):  # bounded: the poll connects once
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"\x00\x00\x18\x04\x00\x00\x00\x00\x00\x00\x04\x00@\x00\x00\r\n\r\n")

    thread = threading.Thread(target=answer_in_frames, daemon=True)
    thread.start()
    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(30)"], {}, tmp_path / "server.log")
    try:
        with pytest.raises(PortTakenError, match="another process holds the port"):
            server.wait_ready(f"http://127.0.0.1:{port}/v1/models", timeout_s=20.0)
    finally:
        server.stop(5.0)
        listener.close()


def test_engine_flags_reach_pdserve_serve_unchanged():
    from deploy.cli import build_parser, engine_options

    options = {"model": "/m", "dtype": "bfloat16", "device": "cuda", "load_format": "dummy", "quantization": "fp8",
               "max_model_len": 4300, "attention_backend": "triton", "enforce_eager": True, "block_size": 16,
               "num_blocks": None, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "fp8", "max_num_seqs": 64,
               "max_num_batched_tokens": 2048, "tensor_parallel_size": 2}
    parsed = engine_options(build_parser().parse_args(["serve", *serve_flags(options)]))
    assert parsed == options


def test_config_only_shape_gets_an_id_only_tokenizer(tmp_path: Path):
    from engine.tokenizer import Tokenizer

    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 300,
                                                   "hidden_size": 64, "intermediate_size": 128,
                                                   "num_hidden_layers": 1, "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "max_position_embeddings": 512}))
    served = servable_model_dir(shape, tmp_path / "scratch")
    assert served != shape and (served / "config.json").read_text() == (shape / "config.json").read_text()
    tok = Tokenizer.from_dir(served)
    assert tok.vocab_size == 300
    assert tok.decode([7, 299]) == "t7 t299"
    assert tok.encode("t5 anything") == [5, 0]  # text still encodes: unknown words are id 0
    assert servable_model_dir(served, tmp_path / "again") == served  # it has a tokenizer now
    assert len(id_only_tokenizer(10)["model"]["vocab"]) == 10


def test_error_lines_pick_the_last_lines_of_tracebacks():
    from bench.server_process import error_lines

    text = ("Traceback (most recent call last):\n  File 'x.py', line 1\n"
            "ValueError: transport 'nccl' cannot run on cpu tensors\n"
            "ray.exceptions.ActorDiedError: The actor died\nINFO all fine\n"
            "ValueError: transport 'nccl' cannot run on cpu tensors\n"
            "ray.exceptions.RayTaskError(RuntimeError): in the controller\n")
    assert error_lines(text) == ["ValueError: transport 'nccl' cannot run on cpu tensors",
                                 "ray.exceptions.ActorDiedError: The actor died",
                                 "ray.exceptions.RayTaskError(RuntimeError): in the controller"]


def test_only_the_disaggregated_mode_gets_the_transport():
    plan = _plan(slo_ttft_ms=1.0, slo_tpot_ms=1.0)
    disagg = plan.server_argv(mode_spec("disagg"), 1, 2, 60.0)
    colocated = plan.server_argv(mode_spec("colocated"), 1, 2, 60.0)
    assert disagg[disagg.index("--transport") + 1] == "nccl" and "--prefill" in disagg
    assert "--transport" not in colocated and colocated[colocated.index("--decode") + 1] == "2"
    assert plan.server_env()["NCCL_NVLS_ENABLE"] == "0" and plan.server_env()["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert "--slo-tpot-ms" not in disagg and "--slo-tpot-ms" not in colocated  # static layouts: as they come


def test_the_admission_limit_reaches_every_mode_only_when_given():
    from deploy.cli import app_config, build_parser

    plan = _plan(slo_ttft_ms=1.0, slo_tpot_ms=1.0)
    assert "--max-in-flight" not in plan.server_argv(mode_spec("colocated"), 1, 2, 60.0)
    plan = dataclasses.replace(plan, max_in_flight=1024)
    for name in ("colocated", "disagg", "adaptive"):
        argv = plan.server_argv(mode_spec(name), 1, 2, 60.0)
        assert app_config(build_parser().parse_args(argv[argv.index("serve"):])).router.max_in_flight == 1024


def test_the_adaptive_mode_steers_to_the_slos_it_is_scored_against():
    from bench.goodput_modes import mode_spec
    from deploy.cli import app_config, build_parser

    plan = _plan(slo_ttft_ms=300.0, slo_tpot_ms=20.0)
    argv = plan.server_argv(mode_spec("adaptive"), 1, 2, 60.0)
    config = app_config(build_parser().parse_args(argv[argv.index("serve"):]))
    assert (config.dispatch.slo.ttft_ms, config.dispatch.slo.tpot_ms,
            config.dispatch.local_prefill.rule) == (300, 20, "slo")
    cluster = config.cluster
    assert (cluster.mode, cluster.num_prefill, cluster.num_decode) == ("disaggregated", 1, 1)
    assert cluster.autoscaler is not None and cluster.autoscaler.max_gpus == 2
    assert cluster.engine.scheduler.itl_budget_ms == pytest.approx(16.0)
    assert mode_spec("adaptive2p2d").num_workers == 4 and mode_spec("adaptive2p2d").steers_to_slos


def test_wait_gpus_free_reads_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from bench.server_process import wait_gpus_free

    used = tmp_path / "used_mib"
    used.write_text("120000")
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"""#!/bin/sh
gpus="0 1"
if [ "$1" = -i ]; then gpus=$(echo "$2" | tr , ' '); shift 2; fi
case "$1" in
  --query-compute-apps=pid) ;;
  --query-gpu=memory.used,memory.total)
    for g in $gpus; do if [ "$g" = 0 ]; then echo "$(cat {used}), 143771"; else echo "0, 143771"; fi; done ;;
esac
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert wait_gpus_free(1.0).startswith("GPUs still busy after 1 s (117.2/140 GiB")
    # a bench on GPU 1 only waits for GPU 1: another bench may hold GPU 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert wait_gpus_free(1.0) == "GPUs free (0.0/140 GiB)"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert wait_gpus_free(1.0).startswith("GPUs still busy after 1 s (117.2/140 GiB, 0.0/140 GiB")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    used.write_text("600")
    assert wait_gpus_free(1.0) == "GPUs free (0.6/140 GiB, 0.0/140 GiB)"


def test_a_timeout_is_named_as_such():
    result = ModeResult("disagg", "d", [])
    result.fail(TimeoutError())
    assert result.status == "failed" and result.error == "TimeoutError: the phase ran past its time limit"


def test_replot_draws_the_png_of_a_json_again(tmp_path: Path):
    pytest.importorskip("matplotlib")
    from bench.goodput import main

    results = Path(__file__).resolve().parents[3] / "bench" / "results" / "goodput_cpu.json"
    copy = tmp_path / "goodput_x.json"
    copy.write_text(results.read_text())
    assert main(["--replot", str(copy)]) == 0
    assert (tmp_path / "goodput_x.png").read_bytes()[:4] == b"\x89PNG"


def test_the_default_drain_cuts_off_no_request_that_meets_the_slos():
    from bench.goodput import slo_drain_s

    assert slo_drain_s(1000.0, 40.0, (100, 300)) == 14.0  # 1 s + 299 x 40 ms = 12.96 s, + 1 s, rounded up
    assert slo_drain_s(1000.0, 40.0, (16, 48)) == 4.0


def test_mode_names_give_the_pool_sizes_and_bad_names_are_refused() -> None:
    from bench.goodput_modes import layout_of, mode_spec

    assert mode_spec("2p6d").serve_flags == ("--prefill", "2", "--decode", "6") and mode_spec("2p6d").num_workers == 8
    assert mode_spec("colocated4").serve_flags == ("--colocated", "--decode", "4")
    assert layout_of(mode_spec("1p3d")) == (1, 3) and layout_of(mode_spec("colocated")) == (0, 2)
    assert layout_of(mode_spec("disagg")) == (1, 1) and layout_of(mode_spec("adaptive")) == (1, 1)
    for bad in ("adaptive0p2d", "0p2d", "2p0d", "colocated0", "3x3", "p2d", "1p1d-tp0x2", "colocated2-tp2x2"):
        with pytest.raises(ValueError, match="unknown mode"):
            mode_spec(bad)


def test_tensor_parallel_modes_count_every_rank_s_gpu() -> None:
    """Issue 28's 4-GPU layouts of the 70B shape: workers of the engine's --tp, or per pool with -tp<A>x<B>."""
    from bench.goodput_modes import mode_spec
    from deploy.cli import app_config, build_parser

    colocated = mode_spec("colocated2", tp=2)
    assert colocated.num_gpus == 4 and colocated.num_workers == 2 and "TP2" in colocated.description
    assert (mode_spec("1p1d", tp=2).num_gpus == 4
            and mode_spec("1p1d", tp=2).serve_flags == ("--prefill", "1", "--decode", "1"))
    hetero = mode_spec("2p1d-tp1x2", tp=2)
    assert hetero.num_gpus == 4 and hetero.serve_flags == ("--prefill", "2", "--decode", "1", "--prefill-tp", "1")
    assert mode_spec("2p1d-tp1x2").serve_flags[-2:] == ("--decode-tp", "2")  # engine TP 1: the decode pool differs
    adaptive = mode_spec("adaptive1p1d", tp=2)
    flags = adaptive.serve_flags
    assert flags[flags.index("--autoscale-max-gpus") + 1] == "4" and adaptive.steers_to_slos
    plan = _plan(1000.0, 40.0)
    argv = plan.server_argv(hetero, 1, 2, 60.0)
    cluster = app_config(build_parser().parse_args([*argv[argv.index("serve"):], "--tp", "2"])).cluster
    assert (cluster.tp_of("prefill"), cluster.tp_of("decode"), cluster.num_prefill) == (1, 2, 2)


def test_push_totals_are_the_prefill_workers_pushes_between_two_metrics_pages() -> None:
    from bench.goodput import push_totals
    from protocol.api import WorkerStatsMsg
    from protocol.messages import PushTotalsMsg
    from router.metrics import PrometheusMetrics

    rows: list[WorkerStatsMsg] = []

    async def stats() -> list[WorkerStatsMsg]:
        return rows

    def worker(name: str, num_pushed: int, seconds: float) -> WorkerStatsMsg:
        totals = PushTotalsMsg(num_pushed=num_pushed, push_seconds=seconds, send_device_seconds=seconds / 100)
        return WorkerStatsMsg(worker_id=name, role="prefill", pid=1, is_healthy=True, num_waiting=0, num_running=0,
                              num_blocks=8, num_free_blocks=8, push_totals=totals)

    metrics = PrometheusMetrics("m", stats)
    rows[:] = [worker("p0", 2, 0.5)]
    metrics.push_bytes.inc(1000)
    before = asyncio.run(metrics.render()).decode()
    rows[:] = [worker("p0", 5, 1.5), worker("p1", 1, 0.5)]
    metrics.push_bytes.inc(4e9)
    totals = push_totals(asyncio.run(metrics.render()).decode(), before)
    assert (totals["num_pushed"], totals["push_seconds"], totals["push_bytes"]) == (4, 1.5, 4e9)
    assert totals["gb_per_s"] == pytest.approx(4e9 / 1.5 / 1e9) and totals["num_failed"] == 0
    assert (totals["send_device_seconds"] == pytest.approx(0.015)
            and totals["device_gb_per_s"] == pytest.approx(4e9 / 0.015 / 1e9))


def test_scaleout_pairs_each_split_with_the_colocated_mode_of_as_many_gpus() -> None:
    from bench.goodput_report import scaleout

    def summary(goodput: float | None) -> dict:
        return {"best": {"goodput": goodput} if goodput is not None else None}

    summaries = {"1p1d": summary(4.0), "colocated": summary(5.0), "2p2d": summary(7.2), "colocated4": summary(9.0),
                 "1p3d": summary(6.0), "2p6d": summary(None)}
    layout = {"1p1d": (1, 1), "colocated": (0, 2), "2p2d": (2, 2), "colocated4": (0, 4), "1p3d": (1, 3), "2p6d": (2, 6)}
    out = scaleout(summaries, layout)
    pairs = {p["mode"]: p for p in out["pairs"]}
    assert pairs["1p1d"]["colocated"] == "colocated" and pairs["1p1d"]["ratio"] == pytest.approx(0.8)
    assert pairs["2p2d"]["colocated"] == "colocated4" and pairs["2p2d"]["ratio"] == pytest.approx(0.8)
    assert pairs["1p3d"]["ratio"] == pytest.approx(6.0 / 9.0)
    assert pairs["2p6d"]["colocated"] is None and pairs["2p6d"]["ratio"] is None  # no colocated8, no goodput
    assert out["scaling_1p1d_to_2p2d"] == pytest.approx(7.2 / 8.0)


def test_a_start_that_lost_its_port_is_tried_once_more(monkeypatch: pytest.MonkeyPatch):
    import bench.goodput as goodput

    from bench.server_process import PortTakenError

    def attempt(taken: str) -> ModeResult:
        result = ModeResult("adaptive", "", [])
        result.phase = "start"
        if taken == "frames":  # the driver's poll met another protocol on the port; the server said nothing yet
            result.fail(PortTakenError("http://127.0.0.1:32845/v1/models answered in another protocol"))
            taken = ""
        else:
            result.fail("ServerError: the server exited with code 1")
        result.log_tail = [taken or "ValueError: bad flag"]
        return result

    http = "OSError: [Errno 98] Address already in use"
    grpc = ("OSError: gRPC cannot bind 127.0.0.1:37161: "
            "Failed to bind to address 127.0.0.1:37161")  # two benches, one host
    for outcomes, expected_calls in (([http, ""], 2), ([grpc, ""], 2), ([""], 1), ([http, grpc], 2),
                                     (["frames", ""], 2)):
        calls = []
        queue = list(outcomes)
        monkeypatch.setattr(goodput, "_run_mode_once", lambda *a: calls.append(1) or attempt(queue.pop(0)))
        result = goodput.run_mode(None, mode_spec("adaptive"), Path("."), 0.0, lambda m: None, lambda m: None)
        assert len(calls) == expected_calls and result.status == "failed"


def test_the_adaptive_mode_starts_in_the_layout_the_planner_picks(tmp_path: Path):
    from bench.goodput import build_parser
    from bench.goodput_modes import mode_spec, plan_adaptive_modes

    from tests.unit.cluster.planner.test_plan import flat

    profile = tmp_path / "profile.json"
    profile.write_text(flat(50.0, 10.0).model_dump_json())
    picks = {}
    for tpot, expected in (("12", "1P1D"), ("1000", "2 colocated")):
        args = build_parser().parse_args(["--modes", "colocated,adaptive", "--plan-profile", str(profile),
                                          "--input-len", "1000", "--output-len", "50", "--slo-ttft-ms", "2000",
                                          "--slo-tpot-ms", tpot])
        specs = {m: mode_spec(m) for m in ("colocated", "adaptive")}
        planned = plan_adaptive_modes(args, specs)
        assert planned["adaptive"]["pick"] == expected and set(planned) == {"adaptive"}
        assert specs["colocated"] == mode_spec("colocated")  # static modes as they were
        picks[expected] = specs["adaptive"]
    assert picks["1P1D"].serve_flags[:4] == ("--prefill", "1", "--decode", "1") and picks["1P1D"].is_kv_transferred
    assert "--local-prefill-rule" in picks["1P1D"].serve_flags
    colocated = picks["2 colocated"]
    assert colocated.serve_flags == ("--colocated", "--decode", "2") and colocated.steers_to_slos
    from deploy.cli import app_config
    from deploy.cli import build_parser as serve_parser

    plan = _plan(slo_ttft_ms=300.0, slo_tpot_ms=20.0)
    argv = plan.server_argv(colocated, 1, 2, 60.0)
    config = app_config(serve_parser().parse_args(argv[argv.index("serve"):]))
    # the router has the SLOs; colocated engines keep no step budget (it lost its measurement there)
    assert config.dispatch.slo.tpot_ms == 20 and config.cluster.engine.scheduler.itl_budget_ms is None


def test_the_warm_up_ends_with_unscored_load_at_the_first_rate(monkeypatch):
    import asyncio
    import dataclasses

    import loadgen.cli
    from bench.goodput import warm_up
    from tests.fake_stream_client import FakeStreamClient

    client = FakeStreamClient()
    monkeypatch.setattr(loadgen.cli, "client_for", lambda config, **kw: client)
    plan = dataclasses.replace(_plan(1000.0, 40.0), rates=(8.0, 12.0), num_warmup=3, warmup_load_s=0.5)
    row = asyncio.run(warm_up(plan, "http://127.0.0.1:1/v1", 30.0))
    assert len(client.sent) == 3 + 4  # the warm-up requests, then 0.5 s at 8 req/s
    assert row is not None and row["rate"] == 8.0 and row["num_completed"] == 4 and row["slo_attainment"] == 1.0
    assert asyncio.run(warm_up(dataclasses.replace(plan, warmup_load_s=0.0), "http://127.0.0.1:1/v1", 30.0)) is None
    assert len(client.sent) == 7 + 3  # the requests alone


def test_a_role_change_is_named_with_the_rate_it_happened_in():
    """The timeline's seconds count from the first rate's start, the driver's log from its own: a move
    at 91 s of the rates was read as a worker gone for the minute after it, when the last rate ran."""
    from bench.goodput import phase_at

    phases = {"start": 40.0, "warm-up": 15.0, "rate 8": 19.0, "rate 12": 17.0, "rate 16": 18.0, "rate 20": 20.0,
              "rate 24": 28.0}
    assert phase_at(0.5, phases) == "rate 8"
    assert phase_at(36.5, phases) == "rate 16"
    assert phase_at(91.0, phases) == "rate 24"
    assert phase_at(103.0, phases) == "after the rates"


def test_the_autoscalers_readings_are_kept_from_the_first_rate_on(tmp_path):
    # `pdserve status --trace` writes each reading at its wall-clock time; the result counts from the rates' start,
    # as the workers' timeline does, and keeps none from before it (the warm-up)
    readings = [{"wall_s": 1000.0 + t, "num_prefill": 1, "num_decode": 1, "prefill": 0.5 * t, "decode": None}
                for t in range(5)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(readings))
    kept = autoscaler_trace(path, rates_started_wall=1002.5)
    assert [r["t_s"] for r in kept] == [0.5, 1.5] and kept[0]["prefill"] == 1.5 and "wall_s" not in kept[0]
    assert autoscaler_trace(tmp_path / "none.json", 0.0) == []
    result = ModeResult(mode="adaptive", description="", serve_argv=[])
    result.autoscaler_trace = kept
    assert mode_summary(result)["autoscaler_trace"] == kept
