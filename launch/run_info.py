"""Resolve a run config for the launch scripts: print `KEY=value` lines (shell-quoted) that bash `eval`s.

    python launch/run_info.py CONFIG [overrides...] [--cluster]

Import-light on purpose (the config schema and the layout arithmetic, no torch, Ray or vLLM), so that the launch
scripts can read a config in a fraction of a second on a login or batch node. With `--cluster` it also resolves
the node counts of a multi-node job: `cluster.trainer_nodes`, `cluster.inference_nodes` and
`cluster.gpus_per_node` from the config, falling back to the environment variables TRAINER_NODES, INFERENCE_NODES
and GPUS_PER_NODE where the config leaves them unset; a config value and an environment variable that disagree
are an error, so that a variable left over in a shell never silently overrides the config.

Errors go to stderr as one line naming the field, and the exit status is 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from megatron_rl.config import ConfigError, load_config
from megatron_rl.parallel.layout import LayoutError, check_layout, layout_from_config

ENV_FALLBACK = {
    "trainer_nodes": "TRAINER_NODES",
    "inference_nodes": "INFERENCE_NODES",
    "gpus_per_node": "GPUS_PER_NODE",
}
"""Environment variables read where the config does not set the cluster field."""


class RunInfoError(ValueError):
    """A config that the launch scripts cannot run as asked."""


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise RunInfoError(f"{name}={raw!r}: must be a positive integer") from None
    if value < 1:
        raise RunInfoError(f"{name}={raw!r}: must be a positive integer")
    return value


def cluster_value(cfg, field: str) -> int | None:
    """A cluster field: the config's when it was set there, else its environment variable, else the default."""
    cluster = getattr(cfg, "cluster", None)
    env_name = ENV_FALLBACK[field]
    from_env = _env_int(env_name)
    if cluster is None:  # a schema without a `cluster:` section
        return from_env if from_env is not None else (8 if field == "gpus_per_node" else None)
    configured = getattr(cluster, field)
    if field in cluster.model_fields_set and configured is not None:
        if from_env is not None and from_env != configured:
            raise RunInfoError(
                f"{env_name}={from_env} disagrees with cluster.{field}={configured} in the config; "
                f"unset {env_name} or pass the override cluster.{field}={from_env}"
            )
        return configured
    return from_env if from_env is not None else configured


def resolve(config: str, overrides: list[str], with_cluster: bool) -> dict[str, str]:
    """Everything the launch scripts need to know about a run, as strings."""
    cfg = load_config(config, overrides)
    layout = layout_from_config(cfg.trainer.parallel)
    check_layout(layout)
    run_dir = Path(cfg.output_dir) / cfg.name
    r = cfg.rollout
    info = {
        "MRL_RUN_NAME": cfg.name,
        "MRL_RUN_DIR": str(run_dir),
        "MRL_SPEC": str(run_dir / "trainer_spec.json"),
        "MRL_WORLD_SIZE": str(layout.world_size),
        "MRL_LAYOUT": layout.describe(),
        "MRL_ENGINE_GPUS": str(r.num_engines * r.engine_tp * r.engine_dp),
        "MRL_TRAINER_TIMEOUT_S": str(int(cfg.trainer.timeout_s)),
        "MRL_SAVE_DIR": cfg.checkpoint.save_dir,
        "MRL_SYNC_BIND_HOST": getattr(cfg.sync, "bind_host", "127.0.0.1"),
    }
    if with_cluster:
        trainer_nodes = cluster_value(cfg, "trainer_nodes")
        inference_nodes = cluster_value(cfg, "inference_nodes")
        gpus_per_node = cluster_value(cfg, "gpus_per_node")
        for field, value in (("trainer_nodes", trainer_nodes), ("inference_nodes", inference_nodes)):
            if value is None:
                raise RunInfoError(
                    f"cluster.{field} is not set: set it in the config, as an override (cluster.{field}=N) "
                    f"or in the environment ({ENV_FALLBACK[field]}=N)"
                )
        if trainer_nodes * gpus_per_node != layout.world_size:
            raise RunInfoError(
                f"cluster.trainer_nodes={trainer_nodes} x cluster.gpus_per_node={gpus_per_node} = "
                f"{trainer_nodes * gpus_per_node} trainer processes, but trainer.parallel gives tp*pp*dp = "
                f"{layout.world_size} ({layout.describe()})"
            )
        info |= {
            "MRL_TRAINER_NODES": str(trainer_nodes),
            "MRL_INFERENCE_NODES": str(inference_nodes),
            "MRL_GPUS_PER_NODE": str(gpus_per_node),
        }
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run_info.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--cluster", action="store_true", help="also resolve the node counts of a multi-node job")
    args = parser.parse_args(argv)

    try:
        info = resolve(args.config, args.overrides, args.cluster)
    except (ConfigError, LayoutError, RunInfoError, FileNotFoundError) as err:
        print(f"run_info.py: error: {err}", file=sys.stderr)
        return 2
    for key, value in info.items():
        print(f"{key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
