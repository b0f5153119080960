"""Input pipelines and the TFDS builders that work offline."""
