"""The deploy files: every cluster YAML passes Ray's own `ray up` validator offline and lays out
pdserve's placement (a pool resource per GPU node type, the NCCL environment), a broken copy fails
naming the file and the key, and the Serve config's application args validate with
deploy.schema.ServeAppConfig. No Ray is started."""

from __future__ import annotations

import copy
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import DECODE_RESOURCE, PREFILL_RESOURCE
from deploy.schema import ServeAppConfig
from deploy.validate import APP_IMPORT_PATH, DeployFileError, load_yaml, main, validate_file
from kvtransfer import NCCL_WORKER_ENV

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
CLUSTER_YAMLS = sorted((DEPLOY / "clusters").glob("*.yaml"))
CLOUD_YAMLS = [p for p in CLUSTER_YAMLS if p.stem != "onprem"]
SERVE_CONFIG = DEPLOY / "serve_config.yaml"


def _write(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def _worker_start_command(config: dict[str, Any]) -> str:
    (command,) = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    return command


def test_the_three_clusters_are_there():
    assert {p.stem for p in CLUSTER_YAMLS} >= {"aws", "gcp", "onprem"}


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.stem)
def test_cluster_yaml_passes_rays_validator(path):
    prepared = validate_file(path)
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_validation_needs_no_cloud_sdk_and_no_network(monkeypatch):
    # NOTE: Ray's prepare_config reads the provider's defaults.yaml from inside Ray and
    # validate_config a JSON schema: no boto3, no Google client, no connection. Prove it.
    for sdk in ("boto3", "botocore", "googleapiclient", "google.cloud", "azure"):
        monkeypatch.setitem(sys.modules, sdk, None)  # importing it now raises ImportError

    def no_network(*args: object) -> None:
        raise AssertionError(f"validation tried to connect to {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    for path in CLUSTER_YAMLS:
        validate_file(path)


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (lambda c: c["available_node_types"]["decode_gpu"].pop("node_config"), "'node_config' is a required property"),
        (lambda c: c.update(max_workers="four"), "at max_workers: 'four' is not of type 'integer'"),
        (lambda c: c["available_node_types"]["prefill_gpu"]["resources"].update(pdserve_prefill=0.5),
         "not of type 'integer'"),
        (lambda c: c["available_node_types"]["prefill_gpu"].update(min_workers=9), "max_workers"),
        (lambda c: c.update(head_node_type="nowhere"), "head_node_type"),
    ],
    ids=["missing-required-key", "wrong-type", "fractional-resource", "min-above-max", "unknown-head"],
)
@pytest.mark.parametrize("source", CLOUD_YAMLS, ids=lambda p: p.stem)
def test_a_broken_cluster_yaml_fails_naming_the_file(tmp_path, source, break_it, expected):
    config = load_yaml(source)
    break_it(config)
    path = _write(tmp_path, f"broken-{source.name}", config)
    with pytest.raises(DeployFileError) as err:
        validate_file(path)
    assert str(err.value).startswith(f"{path}: ")
    assert expected in str(err.value)


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (lambda c: c["provider"].pop("worker_ips"), "list of `worker_ips`"),
        (lambda c: c.update(available_node_types={"x": {"resources": {}, "node_config": {}}}), "not supported"),
        (lambda c: c.update(setup_commands="pip install pdserve"), "not of type 'array'"),
    ],
    ids=["missing-worker-ips", "node-types-on-prem", "wrong-type"],
)
def test_a_broken_onprem_yaml_fails_naming_the_file(tmp_path, break_it, expected):
    config = load_yaml(DEPLOY / "clusters" / "onprem.yaml")
    break_it(config)
    path = _write(tmp_path, "broken-onprem.yaml", config)
    with pytest.raises(DeployFileError, match=re.escape(str(path))) as err:
        validate_file(path)
    assert expected in str(err.value)


def test_the_command_exits_non_zero_and_names_each_broken_file(tmp_path, capsys):
    config = load_yaml(DEPLOY / "clusters" / "aws.yaml")
    config["max_workers"] = "four"
    broken = _write(tmp_path, "broken.yaml", config)
    not_yaml = tmp_path / "not-yaml.yaml"
    not_yaml.write_text("provider: [unclosed\n")
    assert main([str(DEPLOY / "clusters" / "gcp.yaml"), str(broken), str(not_yaml)]) == 1
    out, err = capsys.readouterr()
    assert "gcp.yaml: ok" in out
    assert f"{broken}: at max_workers" in err and f"{not_yaml}: cannot be read as YAML" in err
    assert main([str(p) for p in CLUSTER_YAMLS] + [str(SERVE_CONFIG)]) == 0


@pytest.mark.parametrize("path", CLOUD_YAMLS, ids=lambda p: p.stem)
def test_gpu_node_types_carry_their_pool_resource_one_per_gpu(path):
    config = load_yaml(path)
    head = config["head_node_type"]
    pools: dict[str, list[str]] = {PREFILL_RESOURCE: [], DECODE_RESOURCE: []}
    for name, node_type in config["available_node_types"].items():
        resources = node_type["resources"]
        if name == head:
            assert not set(resources) & {PREFILL_RESOURCE, DECODE_RESOURCE, "GPU"}, resources
            continue
        (pool,) = set(resources) & set(pools)
        assert resources[pool] == resources["GPU"] > 0, (name, resources)
        pools[pool].append(name)
    assert all(pools.values()), pools


def test_a_gpu_node_type_without_its_pool_resource_fails(tmp_path):
    config = load_yaml(DEPLOY / "clusters" / "aws.yaml")
    del config["available_node_types"]["decode_gpu"]["resources"][DECODE_RESOURCE]
    with pytest.raises(DeployFileError, match="'decode_gpu' must offer exactly one of"):
        validate_file(_write(tmp_path, "aws.yaml", config))


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.stem)
def test_workers_start_with_the_nccl_environment(path):
    command = _worker_start_command(load_yaml(path))
    assert "NCCL_SOCKET_IFNAME=" in command
    for key, value in NCCL_WORKER_ENV.items():
        assert f"{key}={value}" in command, key
    assert command.index("export ") < command.index("ray start")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_onprem_hosts_offer_the_resource_of_their_pool(tmp_path):
    # Ray's local provider has no node types: the start command picks the pool from the host's
    # addresses. Run it with a stand-in `ray` that records its arguments.
    config = load_yaml(DEPLOY / "clusters" / "onprem.yaml")
    command = _worker_start_command(config)
    (prefill_hosts,) = re.findall(r'PREFILL_HOSTS="([^"]*)"', command)
    worker_ips = config["provider"]["worker_ips"]
    assert set(prefill_hosts.split()) < set(worker_ips)
    fake_ray = tmp_path / "ray"
    fake_ray.write_text('#!/bin/sh\necho "$@" >> "$RAY_ARGS"\n')
    fake_ray.chmod(0o755)
    for ip in worker_ips:
        args = tmp_path / f"{ip}.args"
        env = {
            **os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "RAY_ARGS": str(args),
            "RAY_HEAD_IP": config["provider"]["head_ip"], "PDSERVE_NODE_IPS": f"172.17.0.1 {ip}",
            "PDSERVE_NUM_GPUS": "8",
        }
        subprocess.run(["bash", "-c", command], env=env, check=True, capture_output=True, timeout=30)
        pool = PREFILL_RESOURCE if ip in prefill_hosts.split() else DECODE_RESOURCE
        assert args.read_text().split("\n")[0] == f'start --address=10.0.0.1:6379 --resources={{"{pool}": 8}}'


# ---- the Serve config


def _serve_args(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = [a for a in config["applications"] if a["import_path"] == APP_IMPORT_PATH]
    return app["args"]


def test_serve_config_parses_and_its_args_validate():
    config = load_yaml(SERVE_CONFIG)
    validate_file(SERVE_CONFIG)  # Ray Serve's schema, then ServeAppConfig
    app = ServeAppConfig.model_validate(_serve_args(config))
    cluster = app.cluster
    assert cluster.mode == "disaggregated"
    assert cluster.prefill_resources == {PREFILL_RESOURCE: 1} and cluster.decode_resources == {DECODE_RESOURCE: 1}
    assert cluster.num_gpus_per_worker == 1 and cluster.transport == "nccl"


@pytest.mark.parametrize("path", CLOUD_YAMLS, ids=lambda p: p.stem)
def test_serve_config_fits_the_cluster(path):
    # One worker per unit of its pool's resource: the pools fit the node types' GPUs at max_workers.
    cluster = ServeAppConfig.model_validate(_serve_args(load_yaml(SERVE_CONFIG))).cluster
    node_types = load_yaml(path)["available_node_types"].values()
    for num_workers, asks in ((cluster.num_prefill, cluster.prefill_resources),
                              (cluster.num_decode, cluster.decode_resources)):
        for resource, amount in asks.items():
            offered = sum(t["resources"].get(resource, 0) * t.get("max_workers", 0) for t in node_types)
            assert num_workers * amount <= offered, (resource, num_workers, offered)


@pytest.mark.parametrize(
    "break_it, field",
    [
        (lambda a: a["cluster"].update(num_decode="many"), "cluster.num_decode"),
        (lambda a: a["cluster"].update(num_prefil=2), "cluster.num_prefil"),
        (lambda a: a["cluster"].update(decode_resources={"GPU": 1}),
         "decode_resources: 'GPU' is not a custom resource"),
        (lambda a: a["cluster"].update(prefill_resources={PREFILL_RESOURCE: 1.5}),
         "prefill_resources['pdserve_prefill'] is 1.5"),
        (lambda a: a.update(num_router_replicas=0), "num_router_replicas"),
        (lambda a: a["cluster"]["engine"]["model"].update(dtype="float64"), "cluster.engine.model.dtype"),
    ],
    ids=["wrong-type", "unknown-field", "builtin-resource", "fractional-resource", "out-of-range", "bad-enum"],
)
def test_broken_serve_args_fail_naming_the_field(tmp_path, break_it, field):
    config = load_yaml(SERVE_CONFIG)
    args = copy.deepcopy(_serve_args(config))
    break_it(args)
    with pytest.raises(ValueError, match=re.escape(field)):
        ServeAppConfig.model_validate(args)
    config["applications"][0]["args"] = args
    path = _write(tmp_path, "serve_config.yaml", config)
    with pytest.raises(DeployFileError, match=re.escape(f"{path}: ")) as err:
        validate_file(path)
    assert field in str(err.value)


def test_serve_config_must_point_at_the_pdserve_builder(tmp_path):
    config = load_yaml(SERVE_CONFIG)
    config["applications"][0]["import_path"] = "somewhere.else:app"
    with pytest.raises(DeployFileError, match="no application has import_path 'deploy.app:build_app'"):
        validate_file(_write(tmp_path, "serve_config.yaml", config))


def test_serve_config_matches_what_pdserve_serve_starts():
    from deploy.app import GRPC_SERVICER_FUNCTIONS
    from deploy.cli import APP_NAME

    config = load_yaml(SERVE_CONFIG)
    (app,) = config["applications"]
    assert app["name"] == APP_NAME
    assert config["grpc_options"]["grpc_servicer_functions"] == GRPC_SERVICER_FUNCTIONS


def test_the_validator_uses_the_configs_resource_names():
    from deploy import validate

    assert (validate.PREFILL_RESOURCE, validate.DECODE_RESOURCE) == (PREFILL_RESOURCE, DECODE_RESOURCE)
