"""Layout rules (weight path regex -> mesh axes), their checks, and the layout report.

`python -m tpu_keras.layout --config=...` prints where every weight of a
config's model lives on its mesh; see `__main__`.
"""

from tpu_keras.layout.rules import (REPLICATE_BELOW, Placement, Placer, Rule, place_all,
                                    replicated, rules_from_pairs)

__all__ = ["REPLICATE_BELOW", "Placement", "Placer", "Rule", "place_all", "replicated",
           "rules_from_pairs"]
