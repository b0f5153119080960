"""How a split is divided among hosts: the one decision, made the same way everywhere.

By file when there are at least as many files as input pipelines (hosts):
host `h` reads files `h, h + H, h + 2H, ...` and nothing else. Otherwise by
example: every host reads every file and keeps every H-th example, which is
exact but reads H times the data, so it is logged as a warning.

Every host computes the same plan from the file counts alone, so all hosts
agree on the number of steps in an epoch without talking to each other.
"""

import dataclasses
import math

from absl import logging
import tensorflow as tf

from tpu_keras.data.sources import Source


@dataclasses.dataclass(frozen=True)
class HostSharding:
    source: Source
    num_hosts: int
    by_file: bool

    def files_of(self, host: int):
        return self.source.files[host::self.num_hosts] if self.by_file else self.source.files

    def examples_of(self, host: int) -> int:
        if self.by_file:
            return self.source.examples_in(self.files_of(host))
        return len(range(host, self.source.num_examples, self.num_hosts))

    def train_steps(self, per_host_batch: int) -> int:
        """Steps in one epoch: every host must take the same number."""
        return min(self.examples_of(h) for h in range(self.num_hosts)) // per_host_batch

    def eval_steps(self, per_host_batch: int) -> int:
        """Steps that cover every host's last example (shorter hosts pad)."""
        return math.ceil(max(self.examples_of(h) for h in range(self.num_hosts)) / per_host_batch)

    def read(self, host: int, deterministic: bool, order_seed=None,
             with_ids: bool = False) -> tf.data.Dataset:
        """This host's examples, decoded; `order_seed` permutes the files.

        The seed must be the same on every host: in the by-example fallback
        all hosts must see one order for `shard` to split it without overlap.
        """
        examples = self.source.read(self.files_of(host), deterministic, order_seed, with_ids)
        return examples if self.by_file else examples.shard(self.num_hosts, host)


def plan(source: Source, num_hosts: int) -> HostSharding:
    by_file = len(source.files) >= num_hosts
    result = HostSharding(source, num_hosts, by_file)
    per_host = [result.examples_of(h) for h in range(num_hosts)]
    if by_file:
        logging.info("sharding %s by file: %d file(s) over %d host(s), %s examples per host",
                     source.name, len(source.files), num_hosts, _span(per_host))
    else:
        logging.warning(
            "sharding %s by example: %d file(s) for %d hosts, so each host reads all %d "
            "examples to keep %s (%.1fx over-read); write at least %d files to shard by file",
            source.name, len(source.files), num_hosts, source.num_examples, _span(per_host),
            source.num_examples / max(per_host), num_hosts)
    return result


def _span(counts):
    low, high = min(counts), max(counts)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"
