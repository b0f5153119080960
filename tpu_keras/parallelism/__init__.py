"""How a model is split over devices: the mesh, the layout rules, and the jax distribution.

`mesh` resolves `config.mesh` against the devices; `rules` holds the
backend-neutral layout rules (weight path regex -> mesh axes) and the
`Placer` that checks them against a model; `distribution` turns them into
the jax engine's `keras.distribution`; `scope` is `cluster.layout(rules)`,
the same for a model built in the user's own code; `host_placement`
loads weights into it shard by shard. Nothing here trains: this package
imports nothing from `tpu_keras.training`.
"""

from tpu_keras.parallelism.rules import (REPLICATE_BELOW, Placement, Placer, Rule, Tie, as_rules,
                                         matching_rules, place_all, replicated,
                                         rules_from_layout_map, rules_from_pairs)

__all__ = ["REPLICATE_BELOW", "Placement", "Placer", "Rule", "Tie", "as_rules", "matching_rules",
           "place_all", "replicated", "rules_from_layout_map", "rules_from_pairs"]
