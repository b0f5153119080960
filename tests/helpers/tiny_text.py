"""A TFDS dataset with a text feature, for tests/helpers/text_eval.py (a builder must live in a module)."""

import pathlib

import numpy as np
import tensorflow_datasets as tfds


def line(i: int) -> str:
    return f"line {i} " * (i % 7 + 1)


class TinyText(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")
    pkg_dir_path = pathlib.Path(__file__).parent  # not a package: say where its metadata would be

    def _info(self):
        return self.dataset_info_from_configs(features=tfds.features.FeaturesDict(
            {"text": tfds.features.Text(), "n": np.int64}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(40), "validation": self._generate_examples(5)}

    def _generate_examples(self, count):
        for i in range(count):
            yield i, {"text": line(i), "n": i}
