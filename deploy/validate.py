"""Checks pdserve's deploy files offline: `python -m deploy.validate FILE...`.

A cluster YAML (anything with a `provider`) goes through what `ray up` runs on it before it
touches a cloud: Ray's `prepare_config` (merges the provider's defaults.yaml that ships inside
Ray, fills min/max workers per node type, and for the local provider builds its single node type)
then Ray's `validate_config` (its JSON schema and cross-field checks), then pdserve's placement
rules (`check_placement`). A Serve config (anything with `applications`) is checked against Ray
Serve's schema, and the pdserve application's `args` against deploy.schema.ServeAppConfig.

Offline: `prepare_config` and `validate_config` import no cloud SDK and call no cloud. The
provider-specific steps that do (`_bootstrap_config`: credentials, AMI/image lookup, subnets,
key pairs, instance-type resources) run only inside `ray up`, after these; so does the SSH of the
local provider. Nothing here starts Ray.

Exits 0 when every file passes; otherwise prints `FILE: what is wrong` for each failing file on
stderr and exits 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

PREFILL_RESOURCE = "pdserve_prefill"  # cluster.config's names; not imported, to keep this light
DECODE_RESOURCE = "pdserve_decode"
APP_IMPORT_PATH = "deploy.app:build_app"


class DeployFileError(ValueError):
    """A deploy file fails validation; the message starts with the file's path."""


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise DeployFileError(f"{path}: cannot be read as YAML: {err}") from err
    if not isinstance(data, dict):
        raise DeployFileError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def validate_cluster_config(config: dict[str, Any]) -> dict[str, Any]:
    """Ray's own checks of a `ray up` config; returns the prepared config (defaults filled).
    Raises what Ray raises: jsonschema.ValidationError, ValueError, KeyError, click's ClickException."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    _check_schema_before_merging(config)
    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


def _check_schema_before_merging(config: dict[str, Any]) -> None:
    """Ray's schema on the file as written, less its required keys (the defaults fill those in).
    NOTE: prepare_config merges before validate_config checks types, so a wrong type such as a
    string for setup_commands would otherwise surface as a TypeError from the merge."""
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, {**schema, "required": []})


def check_placement(prepared: dict[str, Any]) -> None:
    """pdserve's rule for node types (cloud providers; the local provider has none): every GPU
    node type offers exactly one pool resource, one unit per GPU; the head offers none; and
    both pools have a node type."""
    node_types = prepared["available_node_types"]
    pools: dict[str, list[str]] = {PREFILL_RESOURCE: [], DECODE_RESOURCE: []}
    for name, node_type in node_types.items():
        resources = node_type.get("resources", {})
        offered = [r for r in pools if r in resources]
        if name == prepared["head_node_type"]:
            if offered or resources.get("GPU", 0):
                raise ValueError(f"head node type {name!r} must offer no GPU and no pdserve resource, has {resources}")
            continue
        if len(offered) != 1:
            raise ValueError(
                f"node type {name!r} must offer exactly one of {PREFILL_RESOURCE!r} or {DECODE_RESOURCE!r}, "
                f"has {resources}"
            )
        num_gpus = resources.get("GPU")
        if num_gpus is None or resources[offered[0]] != num_gpus:
            raise ValueError(
                f"node type {name!r}: {offered[0]} is {resources[offered[0]]} but GPU is {num_gpus}; "
                "give both, one unit of the pool resource per GPU"
            )
        pools[offered[0]].append(name)
    missing = [r for r, names in pools.items() if not names]
    if missing:
        raise ValueError(f"no node type offers {missing}: each pool needs GPU nodes of its own")


def validate_serve_config(config: dict[str, Any]) -> None:
    """Ray Serve's schema for `serve deploy`, then the pdserve application's args."""
    from ray.serve.schema import ServeDeploySchema

    from deploy.schema import ServeAppConfig

    schema = ServeDeploySchema.model_validate(config)
    apps = [a for a in schema.applications if a.import_path == APP_IMPORT_PATH]
    if not apps:
        raise ValueError(f"no application has import_path {APP_IMPORT_PATH!r}")
    for app in apps:
        ServeAppConfig.model_validate(app.args or {})


def validate_file(path: Path) -> dict[str, Any]:
    """Validates one deploy file; returns what was checked (a cluster config: the prepared one)."""
    config = load_yaml(path)
    try:
        if "applications" in config:
            validate_serve_config(config)
            return config
        if "provider" not in config:
            raise ValueError("neither a cluster config (no 'provider') nor a Serve config (no 'applications')")
        prepared = validate_cluster_config(config)
        if prepared["provider"].get("type") != "local":
            check_placement(prepared)
        return prepared
    except DeployFileError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever Ray or pydantic raise, named with the file
        raise DeployFileError(f"{path}: {_describe(err)}") from err


def _describe(err: BaseException) -> str:
    path = getattr(err, "absolute_path", None)  # jsonschema.ValidationError: where in the file
    if path is not None and getattr(err, "message", None):
        where = "/".join(str(p) for p in path) or "(top level)"
        return f"at {where}: {err.message}"
    if isinstance(err, KeyError):
        return f"missing required key {err}"
    text = getattr(err, "message", None) or str(err) or type(err).__name__
    return f"{type(err).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m deploy.validate FILE...  (cluster YAMLs for `ray up`, Serve configs)", file=sys.stderr)
        return 2
    num_failed = 0
    for path in paths:
        try:
            validate_file(path)
        except DeployFileError as err:
            num_failed += 1
            print(str(err), file=sys.stderr)
        else:
            print(f"{path}: ok")
    return 1 if num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
