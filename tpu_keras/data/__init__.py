"""Input pipelines: TFDS (and our offline builders) to per-replica batches."""

from tpu_keras.data.pipeline import build

__all__ = ["build"]
