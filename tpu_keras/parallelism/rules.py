"""Layout rules: which weight is split along which mesh axis, checked against the model.

A `Rule` maps a regex, `re.fullmatch`ed against a Keras `variable.path` such
as `block0_mlp_up/kernel`, to one mesh axis name (or None) per dimension of
the weight. Rules are backend-neutral: the jax engine turns them into a
`keras.distribution.LayoutMap`; the tf engine, data parallel only, checks
them and replicates every weight.

Keras replicates a weight no rule matches, without a word (docs/design.md).
`Placer` refuses instead, with one line, when:
- a rule matches no weight (a typo, or a renamed layer);
- two rules match the same weight;
- a sharded dimension does not divide by its mesh axis;
- on a mesh with a model (or expert) axis above 1, a weight of
  `replicate_below` elements or more matches no rule (list it with
  `replicated(...)` if that is intended);
- the dimensions a `Tie` names (attention heads in the query and the output
  kernels, say) are split over different axes.

With `fsdp` above 1, every weight of `replicate_below` elements or more is
also split over `fsdp`, after the rules: on its largest dimension that
divides by it and that no rule split (`Placement.note` says which, or why
none could be).

A rule that is a weight's path itself wins over patterns, and two patterns
matching one path are an error: Keras's `LayoutMap` looks paths up the same
way, so a keras-hub `get_layout_map` means here what it means to Keras.
"""

# Imported inside functions: NumPy (start-up time: not every caller needs it).
import collections.abc
import dataclasses
import math
import re
from typing import Iterable, Optional, Sequence

from tpu_keras.errors import UserError, closest
from tpu_keras.parallelism.mesh import CONTEXT, SLICES

# Axes that split only the batch (and `context`, its sequences): a large weight on a mesh of
# these alone needs no rule. Not `expert`: it splits the batch too, but also a mixture of
# experts' experts, by the family's rules, so above 1 every large weight needs a rule.
_BATCH_ONLY = (SLICES, "data", "fsdp", CONTEXT)

# Weights this large (elements) must be covered by a rule: 65,536 is a 256x256 kernel.
REPLICATE_BELOW = 65_536


@dataclasses.dataclass(frozen=True)
class Rule:
    """`axes[i]` is the mesh axis dimension i of matching weights is split over (None: whole)."""

    pattern: str
    axes: tuple[Optional[str], ...] = ()  # () replicates matching weights, on purpose

    def matches(self, path: str) -> bool:
        return re.fullmatch(self.pattern, path) is not None


def replicated(pattern: str) -> Rule:
    """A rule that keeps matching weights whole on every device, on purpose."""
    return Rule(pattern, ())


def rules_from_pairs(pairs: Iterable[Sequence]) -> list[Rule]:
    """Rules from `(pattern, axes)` pairs, as a config file writes them."""
    return [Rule(str(pattern), tuple(axes or ())) for pattern, axes in pairs]


def refuse_across_slices(rule: Rule, mesh: dict[str, int]) -> None:
    """Weights are never split across slices: gathering them every step over the
    data-center network would cost far more than the memory saved. `data` spans the
    slices when there are several."""
    slices = mesh.get(SLICES, 1)
    for axis in rule.axes:
        if axis == SLICES or (axis == "data" and slices > 1):
            spans = "" if axis == SLICES else f", which spans the {slices} slices,"
            raise UserError(f"layout rule '{rule.pattern}' splits weights over mesh axis {axis!r}"
                            f"{spans} but weights are never split across slices (the data-center "
                            "network is too slow to gather them each step); name 'fsdp' or 'model'")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one weight lives: its mesh axis per dimension, and the rule that said so."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple[Optional[str], ...]
    rule: Optional[str]
    note: str = ""  # what fsdp did with it, and why

    def shard_shape(self, mesh: dict[str, int]) -> tuple[int, ...]:
        return tuple(n // mesh[a] if a else n for n, a in zip(self.shape, self.axes))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    def bytes_per_device(self, mesh: dict[str, int]) -> int:
        return math.prod(self.shard_shape(mesh)) * _itemsize(self.dtype)

    @property
    def spec(self) -> str:
        """The layout as JAX prints a PartitionSpec: P(None, 'model')."""
        return "P(" + ", ".join(repr(a) if a else "None" for a in self.axes) + ")" if self.axes else "P()"


class Placer:
    """Places weights one at a time by the rules, and remembers what it placed.

    A weight is placed once: the jax engine places each as Keras creates it,
    and a later `place_all` over the model returns those placements.
    """

    def __init__(self, rules: Sequence[Rule], mesh: dict[str, int],
                 replicate_below: int = REPLICATE_BELOW, ties: Sequence["Tie"] = (),
                 split_logits: bool = False):
        self.rules, self.mesh, self.replicate_below = list(rules), dict(mesh), replicate_below
        self.ties = list(ties)
        # layout.split_logits (models.vocabulary_split), where fsdp alone splits the head
        self.split_logits = split_logits and self.mesh.get("fsdp", 1) > 1 and self.mesh.get("model", 1) == 1
        # Only a model axis makes an uncovered large weight a likely mistake (fsdp splits it).
        self._splits_weights = any(size > 1 for axis, size in self.mesh.items()
                                   if axis not in _BATCH_ONLY)
        self._fsdp = self.mesh.get("fsdp", 1)
        self._used: set[str] = set()
        self._placed: dict[tuple[str, tuple[int, ...]], Placement] = {}
        for rule in self.rules:
            refuse_across_slices(rule, self.mesh)
            if CONTEXT in rule.axes:
                raise UserError(f"layout rule '{rule.pattern}' splits weights over mesh axis "
                                f"{CONTEXT!r}, which splits sequences, not weights; split them over "
                                "'fsdp' or 'model'")
            unknown = [a for a in rule.axes if a is not None and a not in self.mesh]
            if unknown:
                raise UserError(f"layout rule '{rule.pattern}' names mesh axis {unknown[0]!r}; "
                                f"the mesh axes are {sorted(self.mesh)}{closest(unknown[0], self.mesh)}")

    def place(self, path: str, shape: Sequence[int], dtype: str = "float32") -> Placement:
        shape = tuple(int(n) for n in shape)
        if (path, shape) not in self._placed:
            self._placed[path, shape] = self._with_fsdp(self._place(path, shape, dtype))
        return self._placed[path, shape]

    def _with_fsdp(self, placement: Placement) -> Placement:
        """Splits a large weight over `fsdp` too, on its largest dimension that divides by
        it and that no rule split already (a rule may also name `fsdp` itself; an axis of
        size 1 splits nothing)."""
        if self._fsdp == 1 or "fsdp" in placement.axes or math.prod(placement.shape) < self.replicate_below:
            return placement
        axes = placement.axes or (None,) * len(placement.shape)
        # A dimension on an axis of size 1 is not split: fsdp may take it.
        free = [d for d, (n, a) in enumerate(zip(placement.shape, axes))
                if (a is None or self.mesh.get(a, 1) == 1) and n % self._fsdp == 0]
        if not free:
            return dataclasses.replace(placement, note=(
                f"whole over fsdp: no unsplit dimension of {list(placement.shape)} divides by "
                f"fsdp={self._fsdp}"))
        dim = max(free, key=lambda d: placement.shape[d])
        return dataclasses.replace(placement, axes=axes[:dim] + ("fsdp",) + axes[dim + 1:],
                                   note=f"fsdp on dimension {dim}")

    def _suggest(self, path: str, shape: tuple[int, ...]) -> str:
        """', such as layout.extra_rules=((r'PATH', (None, 'model')),)': the widest weight
        axis split over its largest dimension that divides by it."""
        axes = [a for a in self.mesh if a not in _BATCH_ONLY and self.mesh[a] > 1]
        axes = [a for a in axes if a != "expert"]  # the experts' own axis: no advice for others
        if not axes:
            return ""
        axis = max(axes, key=lambda a: self.mesh[a])
        fits = [d for d, n in enumerate(shape) if n % self.mesh[axis] == 0]
        if not fits:
            return ""
        dim = max(fits, key=lambda d: shape[d])
        spec = ", ".join(repr(axis) if d == dim else "None" for d in range(len(shape)))
        return f", such as layout.extra_rules=((r'{path}', ({spec}{',' if len(shape) == 1 else ''})),)"

    def place_all(self, variables) -> list[Placement]:
        """Places every variable (anything with .path, .shape, .dtype)."""
        return [self.place(v.path, v.shape, dtype_name(v.dtype)) for v in variables]

    def _place(self, path: str, shape: tuple[int, ...], dtype: str) -> Placement:
        matching = matching_rules(self.rules, path)
        if len(matching) > 1:  # rules for one path in several shapes: the one of this rank
            matching = [rule for rule in matching if len(rule.axes) in (0, len(shape))] or matching
        if len(matching) > 1:
            raise UserError(f"weight {path!r} matches two layout rules, '{matching[0].pattern}' "
                            f"and '{matching[1].pattern}'; make the patterns exclusive")
        if not matching:
            if self._splits_weights and math.prod(shape) >= self.replicate_below:
                raise UserError(f"weight {path!r} {list(shape)} ({math.prod(shape):,} elements) is "
                                "covered by no layout rule; add a rule that shards it"
                                f"{self._suggest(path, shape)}, or replicated({path!r}) to "
                                "keep it whole on every device")
            return Placement(path, shape, dtype, (None,) * len(shape), None)
        rule = matching[0]
        self._used.add(rule.pattern)
        if not rule.axes:
            return Placement(path, shape, dtype, (None,) * len(shape), rule.pattern)
        if len(rule.axes) != len(shape):
            raise UserError(f"layout rule '{rule.pattern}' gives {len(rule.axes)} axes for weight "
                            f"{path!r} of shape {list(shape)}; give one axis (or None) per dimension")
        for dim, (size, axis) in enumerate(zip(shape, rule.axes)):
            if axis and size % self.mesh[axis]:
                raise UserError(f"weight {path!r} {list(shape)}: dimension {dim} ({size}) does not "
                                f"divide by mesh axis {axis!r} ({self.mesh[axis]}); change the rule "
                                f"'{rule.pattern}', the model size, or mesh.{axis}")
        return Placement(path, shape, dtype, rule.axes, rule.pattern)

    def check(self, variables=None) -> list[Placement]:
        """Places every variable of a built model (None: the weights placed so far, as Keras
        created them); checks that every rule was used and that every tie holds."""
        placements = self.place_all(variables) if variables is not None else list(self._placed.values())
        self.check_all_rules_used()
        for tie in self.ties:
            tie.check(placements, self.mesh)
        return placements

    def check_all_rules_used(self) -> None:
        paths = [path for path, _ in self._placed]
        for rule in self.rules:
            # Used, or matching a weight that a rule for its other rank placed (a quantized kernel).
            if rule.pattern not in self._used and not any(re.fullmatch(rule.pattern, p) for p in paths):
                example = paths[-1] if paths else "dense/kernel"
                raise UserError(f"layout rule '{rule.pattern}' matches no weight"
                                f"{closest(rule.pattern, paths)}; rules are re.fullmatch-ed "
                                f"against weight paths such as {example!r}")


@dataclasses.dataclass(frozen=True)
class Tie:
    """Dimensions of several weights that are one dimension of the model, such as
    attention heads in the query, key, value and output kernels.

    Split two ways (heads over `data` in the query kernel, over `model` in the
    output kernel), every step reshuffles the activations between the two
    matmuls across devices: the result is right and slow. `members` are
    `(pattern, dimension)` pairs; `name` says what the dimension is.
    """

    name: str
    members: tuple[tuple[str, int], ...]

    def check(self, placements: Sequence[Placement], mesh: dict[str, int]) -> None:
        seen = {}  # axis (None: whole) -> (path, dimension) of the first weight split so
        for placement in placements:
            for pattern, dim in self.members:
                if re.fullmatch(pattern, placement.path) and dim < len(placement.axes):
                    axis = placement.axes[dim]
                    # Size 1 splits nothing; fsdp weights are gathered whole before use.
                    axis = axis if axis and axis != "fsdp" and mesh.get(axis, 1) > 1 else None
                    seen.setdefault(axis, (placement.path, dim))
        if len(seen) > 1:
            (axis_a, (path_a, dim_a)), (axis_b, (path_b, dim_b)) = list(seen.items())[:2]
            raise UserError(f"the {self.name} are split two ways: {path_a!r} dimension {dim_a} "
                            f"over {axis_a!r}, {path_b!r} dimension {dim_b} over {axis_b!r}, so "
                            "every step reshuffles activations between devices; split them over "
                            "one mesh axis in the layout rules")


def matching_rules(rules: Sequence[Rule], path: str) -> list[Rule]:
    """The rules that place a weight of `path`, as Keras's LayoutMap looks a path up: a rule
    that is the path itself wins, otherwise every rule is re.fullmatch-ed (more than one
    match is the caller's error)."""
    return [rule for rule in rules if rule.pattern == path] or [r for r in rules if r.matches(path)]


def as_rules(rules) -> list[Rule]:
    """Rules given as `Rule`s, `(pattern, axes)` pairs or a `keras.distribution.LayoutMap`."""
    if isinstance(rules, collections.abc.Mapping):  # a LayoutMap is one
        return rules_from_layout_map(rules)
    return [rule if isinstance(rule, Rule) else rules_from_pairs([rule])[0] for rule in rules]


def rules_from_layout_map(layout_map) -> list[Rule]:
    """Rules from a `keras.distribution.LayoutMap` (a keras-hub `get_layout_map`), in
    its order; `Placer` then looks paths up exactly as the LayoutMap would."""
    return [Rule(key, tuple(layout_map[key].axes)) for key in layout_map]


def place_all(variables, rules: Sequence[Rule], mesh: dict[str, int],
              replicate_below: int = REPLICATE_BELOW) -> list[Placement]:
    """Places every variable (anything with .path, .shape, .dtype); checks every rule was used."""
    return Placer(rules, mesh, replicate_below).check(variables)


def dtype_name(dtype) -> str:
    return getattr(dtype, "name", None) or str(dtype)


def _itemsize(dtype: str) -> int:
    import numpy as np
    if dtype == "bfloat16":
        return 2
    return np.dtype(dtype).itemsize
