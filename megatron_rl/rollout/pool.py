"""A pool of vLLM engine actors placed with Ray placement groups, with request routing and health checks."""

from __future__ import annotations

import itertools
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatron_rl.rollout.engine import EngineSpec, GenerationRequest, VLLMEngine
from megatron_rl.weights.sync import EngineHandle, ray_get_named


class EnginePool:
    """N engines, one placement-group bundle each (CPUs on CPU machines, tp*dp GPUs on GPU machines)."""

    def __init__(self, specs: list[EngineSpec], cpus_per_engine: float = 1.0, use_gpus: bool = False):
        self.specs = specs
        self.cpus_per_engine = cpus_per_engine
        self.use_gpus = use_gpus
        self.actors: dict[str, object] = {}
        self.placement_group = None
        self._starting: dict[str, object] = {}
        self._round_robin = itertools.cycle(range(len(specs)))

    def _bundle(self, spec: EngineSpec) -> dict:
        bundle = {"CPU": self.cpus_per_engine}
        if self.use_gpus:
            bundle["GPU"] = spec.tensor_parallel * spec.data_parallel
        return bundle

    def start(self, timeout_s: float = 600.0) -> list[dict]:
        """Reserve the placement group, create the actors and start vLLM in each; errors name the engine."""
        self.create(timeout_s)
        return self.wait_started(timeout_s)

    def create(self, timeout_s: float = 600.0) -> None:
        """Reserve the placement group, create the actors and have each start vLLM, without waiting for it."""

        self.placement_group = placement_group([self._bundle(s) for s in self.specs], strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_s)
        if not ready:
            raise RuntimeError(
                f"engine placement group {self.placement_group.bundle_specs} not ready in {timeout_s:.0f} s"
            )
        for index, spec in enumerate(self.specs):
            self.actors[spec.name] = self._create_actor(index, spec)
        self._starting = {name: actor.start.remote() for name, actor in self.actors.items()}

    def wait_started(self, timeout_s: float = 600.0) -> list[dict]:
        """Wait for the starts `create` began; health reports, or SyncError naming the engines that failed."""
        return list(ray_get_named(self._starting, timeout_s, "starting vLLM").values())

    def _create_actor(self, index: int, spec: EngineSpec):
        """The engine actor of `spec` in its placement-group bundle (vLLM not yet started)."""

        strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=index)
        return (
            ray.remote(VLLMEngine)
            .options(
                name=spec.name,
                num_cpus=self.cpus_per_engine,
                num_gpus=self._bundle(spec).get("GPU", 0),
                scheduling_strategy=strategy,
                max_concurrency=1000,
            )
            .remote(spec)
        )

    def restart(self, name: str, timeout_s: float = 600.0):
        """Replace engine `name` (dead or alive) by a fresh actor of the same name in the same bundle, with vLLM
        started from the spec's checkpoint; returns the new actor. Its weights are the start-up ones: the trainer
        brings it to the current version."""

        index = next((i for i, s in enumerate(self.specs) if s.name == name), None)
        if index is None:
            raise KeyError(f"restart: no engine named {name!r} (engines: {[s.name for s in self.specs]})")
        ray.kill(self.actors[name], no_restart=True)
        deadline = time.monotonic() + timeout_s
        while True:  # Ray frees the name of a killed actor asynchronously
            try:
                actor = self._create_actor(index, self.specs[index])
                break
            except ValueError as err:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"restart of {name}: its name is still taken after {timeout_s:.0f} s") from err
                time.sleep(0.5)
        self.actors[name] = actor
        ray_get_named({name: actor.start.remote()}, max(1.0, deadline - time.monotonic()), f"restarting {name}")
        return actor

    def handles(self) -> list[EngineHandle]:
        """What the trainer's weight sync needs of each engine."""
        return [
            EngineHandle(spec.name, self.actors[spec.name], spec.tensor_parallel * spec.data_parallel)
            for spec in self.specs
        ]

    def submit(self, request: GenerationRequest, engine: str | None = None):
        """Send a request to an engine (round robin unless named); returns the Ray ObjectRef of the result."""
        name = engine or self.specs[next(self._round_robin)].name
        return self.actors[name].generate.remote(request)

    def health(self, timeout_s: float = 30.0) -> list[dict]:
        """Health reports of every engine."""
        futures = {name: actor.health.remote() for name, actor in self.actors.items()}
        return list(ray_get_named(futures, timeout_s, "health check").values())

    def pids(self, timeout_s: float = 10.0) -> dict[int, str]:
        """Process id -> engine name of every engine that answers within `timeout_s` (for naming its logs)."""
        futures = {name: actor.health.remote() for name, actor in self.actors.items()}
        pids = {}
        for name, future in futures.items():
            try:
                pids[ray.get(future, timeout=timeout_s)["pid"]] = name
            except Exception:  # a dead or stuck engine: its log keeps its pid for a name
                continue
        return pids

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop vLLM in every engine and release the actors and placement group."""

        deadline = time.monotonic() + timeout_s
        for actor in self.actors.values():
            try:
                ray.get(actor.shutdown.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except Exception:  # a dead engine has nothing left to stop
                pass
            ray.kill(actor)
        self.actors = {}
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
