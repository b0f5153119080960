"""JSON-lines files read line by line, wherever `tf.io.gfile` reaches (gs:// too): GRPO's
prompts (`data.prompts`) and `generate --prompts_file`."""

import json

import tensorflow as tf


def records(path: str):
    """(line number, the line's JSON value, or None where it is not JSON) of each line
    that is not blank; the callers say what a good line holds."""
    with tf.io.gfile.GFile(path) as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError:
                yield number, None
