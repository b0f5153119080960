"""The `Cluster` record: what `connect` found, the same shape on both engines.

Engine-neutral and light (no TensorFlow, no JAX): everything above the
cluster package reads a `Cluster` and never asks which engine built it.
"""

import contextlib
import dataclasses
from typing import Any, Optional

from tpu_keras.parallelism import REPLICATE_BELOW, mesh as mesh_lib, scope

# cluster.strategy: 'auto', then the kinds it picks from, in order.
STRATEGIES = ("auto", "tpu", "multi_worker", "mirrored", "one_device")
KINDS = STRATEGIES[1:]


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What `connect` found: the strategy (or jax mesh) and the shape of the machine.

    `num_replicas` is the number of ways the global batch is split: the
    mesh's `slices` x `data` x `fsdp` x `expert` (tf: the strategy's replicas).
    """

    strategy: Optional[Any]              # the tf.distribute.Strategy; None on the jax engine
    kind: str
    num_hosts: int
    host_index: int
    num_replicas: int
    device_kind: str
    topology: Optional[Any] = None
    engine: str = "tf"
    mesh: Optional[dict] = None          # {'slices': S, 'data': D, 'fsdp': F, 'expert': E, 'model': M}
    device_mesh: Optional[Any] = None    # keras.distribution.DeviceMesh (jax)
    # Distinct input pipelines and the one this host runs: one per host,
    # unless a jax model axis spans hosts that then read the same rows.
    input_pipelines: int = 0
    input_index: int = -1

    def __post_init__(self):
        if self.mesh is None:
            object.__setattr__(self, "mesh", {"slices": 1, "data": self.num_replicas, "fsdp": 1,
                                              "expert": 1, "model": 1})
        if not self.input_pipelines:
            object.__setattr__(self, "input_pipelines", self.num_hosts)
            object.__setattr__(self, "input_index", self.host_index)

    @property
    def replicas_per_host(self) -> int:
        return self.num_replicas // self.num_hosts

    @property
    def num_processes(self) -> int:
        """Python processes in the run: one per host, except on TPUStrategy, whose single
        client drives every host of the slice."""
        return 1 if self.kind == "tpu" else self.num_hosts

    @property
    def is_chief(self) -> bool:
        """The one host that writes shared files (config, checkpoints, export)."""
        return self.host_index == 0

    def scope(self):
        """Where models and optimizers are created: the strategy's scope on tf.

        On jax the distribution is global in Keras and already set (by
        `connect`, then by the run from the model's layout), so there is
        nothing to enter; `layout(rules)` is the scope that lays out a model
        of the user's own.
        """
        return self.strategy.scope() if self.strategy else contextlib.nullcontext()

    def layout(self, rules=(), *, replicate_below: Optional[int] = None, ties=()):
        """A scope whose weights are laid out by `rules` over this cluster's mesh, and
        checked as a run checks them (`parallelism.scope.LayoutScope`):

            with cluster.layout([Rule(r"block\\d+_mlp_up/kernel", (None, "model")), ...]):
                model = make_model()
                model.compile(...)
        """
        return scope.LayoutScope(self, rules, REPLICATE_BELOW if replicate_below is None else replicate_below,
                                 ties)

    def describe(self) -> str:
        if self.engine == "jax":
            return (f"jax mesh {mesh_lib.describe(self.mesh)} over "
                    f"{self.num_hosts} process(es), this is process {self.host_index}, "
                    f"devices: {self.device_kind}")
        return (f"{self.kind} strategy: {self.num_replicas} replica(s) on "
                f"{self.num_hosts} host(s) ({self.replicas_per_host} per host), "
                f"this is host {self.host_index}, devices: {self.device_kind}")
