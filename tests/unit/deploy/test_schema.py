"""ServeAppConfig's dispatch block: `pdserve serve` flags and the Serve config's args reach the
routers' DispatcherConfig, and a bad value is refused naming the field."""

from __future__ import annotations

import pydantic
import pytest

from deploy.cli import app_config, build_parser
from deploy.schema import ServeAppConfig


def test_serve_flags_set_the_local_prefill_rule_and_threshold() -> None:
    args = build_parser().parse_args(
        ["serve", "--prefill", "1", "--decode", "1", "--local-prefill-rule", "remote",
         "--local-prefill-max-tokens", "64"]
    )
    local = app_config(args).dispatch.local_prefill
    assert (local.rule, local.max_short_prompt_tokens) == ("remote", 64)
    defaults = app_config(build_parser().parse_args(["serve"])).dispatch.local_prefill
    assert (defaults.rule, defaults.max_short_prompt_tokens) == ("short_or_cached", 192)


def test_a_bad_dispatch_block_names_the_field() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"local_prefill\.rule 'bogus' is unknown"):
        ServeAppConfig.model_validate({"dispatch": {"local_prefill": {"rule": "bogus"}}})
    with pytest.raises(pydantic.ValidationError, match="max_short_prompt_tokens"):
        ServeAppConfig.model_validate({"dispatch": {"local_prefill": {"max_short_prompt_tokens": -1}}})
    with pytest.raises(pydantic.ValidationError, match="unknown_field"):
        ServeAppConfig.model_validate({"dispatch": {"unknown_field": 1}})


def test_serve_flags_set_each_pools_tensor_parallel_size():
    cluster = app_config(build_parser().parse_args(["serve", "--tp", "2", "--decode-tp", "4"])).cluster
    assert cluster.engine.parallel.tensor_parallel_size == 2 and cluster.tp_of("decode") == 4


def test_slo_flags_reach_the_dispatcher():
    args = build_parser().parse_args(["serve", "--prefill", "1", "--slo-tpot-ms", "40", "--slo-ttft-ms", "1000",
                                      "--local-prefill-rule", "slo"])
    config = app_config(args)
    dispatch = config.dispatch
    assert (dispatch.slo.tpot_ms, dispatch.slo.ttft_ms, dispatch.local_prefill.rule) == (40, 1000, "slo")
    assert config.cluster.engine.scheduler.itl_budget_ms == pytest.approx(32)  # STEP_SHARE of the TPOT SLO
    colocated = app_config(build_parser().parse_args(["serve", "--slo-tpot-ms", "40", "--slo-ttft-ms", "1000"]))
    assert colocated.dispatch.slo.tpot_ms == 40 and colocated.cluster.engine.scheduler.itl_budget_ms is None


def test_autoscale_flags_size_the_pools_against_the_slos():
    args = ["serve", "--prefill", "1", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "40", "--autoscale-max-gpus", "4"]
    autoscaler = app_config(build_parser().parse_args(args)).cluster.autoscaler
    assert autoscaler is not None and (autoscaler.ttft_ms, autoscaler.tpot_ms, autoscaler.max_gpus) == (1000, 40, 4)
    with pytest.raises(SystemExit, match="give --slo-ttft-ms and --slo-tpot-ms too"):
        app_config(build_parser().parse_args(["serve", "--autoscale-max-gpus", "4"]))


def test_max_in_flight_flag_sets_each_router_replicas_limit():
    assert app_config(build_parser().parse_args(["serve"])).router.max_in_flight == 256
    args = build_parser().parse_args(["serve", "--num-router-replicas", "2", "--max-in-flight", "512"])
    assert app_config(args).router.max_in_flight == 512
    with pytest.raises(pydantic.ValidationError, match="max_in_flight"):
        app_config(build_parser().parse_args(["serve", "--max-in-flight", "0"]))


def test_a_config_file_takes_the_listen_addresses_and_key_it_leaves_unset_from_the_flags(tmp_path) -> None:
    """`serve --config`: a file without http/grpc/api_key would serve neither port and drop --api-key;
    the flags fill them. What the file sets wins."""
    bare = tmp_path / "bare.json"
    bare.write_text('{"cluster": {"mode": "colocated"}}')
    args = build_parser().parse_args(["serve", "--config", str(bare), "--host", "127.0.0.2", "--port", "8123",
                                      "--grpc-port", "9123", "--api-key", "s3cret"])
    config = app_config(args)
    assert (config.http.host, config.http.port, config.grpc.port) == ("127.0.0.2", 8123, 9123)
    assert config.router.api_key == "s3cret"
    full = tmp_path / "full.json"
    full.write_text('{"http": {"host": "127.0.0.1", "port": 7000}, "grpc": {"host": "127.0.0.1", "port": 7001}, '
                    '"router": {"api_key": "file-key"}}')
    config = app_config(build_parser().parse_args(["serve", "--config", str(full), "--port", "8123",
                                                   "--api-key", "flag-key"]))
    assert (config.http.port, config.grpc.port, config.router.api_key) == (7000, 7001, "file-key")


@pytest.mark.parametrize(("flags", "named"), [
    (["--prefill-tp", "2"], "--prefill-tp apply to prefill workers"),
    (["--local-prefill-rule", "remote", "--local-prefill-max-tokens", "64"],
     "--local-prefill-rule, --local-prefill-max-tokens apply to prefill workers"),
    (["--prefill", "0"], "--prefill 0: disaggregated mode needs at least 1 prefill worker"),
    (["--autoscale-min-prefill", "0"], "--autoscale-min-prefill bounds the autoscaler"),
])
def test_flags_that_would_do_nothing_are_refused_by_name(flags, named) -> None:
    with pytest.raises(SystemExit, match=named):
        app_config(build_parser().parse_args(["serve", *flags]))
