"""scikit-learn's bundled 8x8 handwritten digits as a TFDS dataset.

The images ship inside the scikit-learn wheel, so image classification can be
trained and tested without any download.
"""
# Imported inside functions: scikit-learn (optional: absent on a plain install).
import functools

import numpy as np
import tensorflow_datasets as tfds

TEST_EVERY = 5  # Example i is a test example when i % TEST_EVERY == 0.
# At least one file per input pipeline (host) for `tfds.ReadConfig(input_context=...)`.
NUM_SHARDS = {"train": 8, "test": 4}


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """Returns (images (N, 8, 8, 1) uint8 with values 0..16, labels (N,))."""
    try:
        from sklearn import datasets  # pylint: disable=g-import-not-at-top
    except ImportError as error:
        raise RuntimeError(
            "The digits dataset needs scikit-learn: pip install scikit-learn") from error
    digits = datasets.load_digits()
    return digits.images.astype(np.uint8)[..., np.newaxis], digits.target


def _shard_examples(indices, images, labels, shard_index: int, num_shards: int):
    """Yields every num_shards-th example, keyed by its index in load_digits()."""
    for index in indices[shard_index::num_shards]:
        yield int(index), {"image": images[index], "label": labels[index]}


class Digits(tfds.core.ShardBasedBuilder):
    """8x8 grey digit images with labels 0..9.

    ShardBasedBuilder because it fixes the number of files per split inside the
    builder; GeneratorBasedBuilder would write each split as one file.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=(
                "sklearn.datasets.load_digits: 1797 8x8 images of handwritten "
                "digits with pixel values 0..16. Every fifth example is in test."),
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
                "label": tfds.features.ClassLabel(num_classes=10),
            }),
            supervised_keys=("image", "label"),
        )

    def _shard_iterators_per_split(self, dl_manager):
        del dl_manager  # Nothing to download.
        images, labels = load_digits()
        is_test = np.arange(len(labels)) % TEST_EVERY == 0
        indices = {"train": np.flatnonzero(~is_test), "test": np.flatnonzero(is_test)}
        return {
            split: [
                functools.partial(
                    _shard_examples, indices[split], images, labels, shard, num_shards)
                for shard in range(num_shards)
            ]
            for split, num_shards in NUM_SHARDS.items()
        }
