"""The config's data section in parts: the one a run reads, and where each old key went.

Each kind of data has a part of its own, and a key belongs to one part:

    data.tfds          a TFDS dataset: name and splits
    data.tfrecords     TFRecord files and their feature spec
    data.text          plain text documents (.txt, .jsonl), or a TFDS dataset's text feature
    data.instructions  .jsonl prompts and responses (the loss counts the responses)
    data.preferences   .jsonl prompts with a chosen and a rejected response (DPO)
    data.prompts       .jsonl prompts the policy completes, scored by reward functions (GRPO)
    data.tokens        how text becomes tokens: tokenizer, context length, token counts

The keys left at the top of the section (`data_dir`, `preprocess`, the shuffle and the
cache, ...) apply to every kind. A run reads the part whose files (or TFDS name) it sets;
a part it does not read is refused if set, so a key meant for one kind of data is never
silently ignored by another. Runs before the parts wrote a flat section; `migrated` moves
their keys (a workdir's config.json), and `moved` says where each went (a user's config).
No TensorFlow here: the config is checked before an engine loads.
"""

import ml_collections

from tpu_keras.errors import UserError

# What each part reads, by the key that names its files (or dataset).
KINDS = ("tfds", "tfrecords", "text", "instructions", "preferences", "prompts")
WHERE = {"tfds": "name", "tfrecords": "files", "text": "files", "instructions": "files",
         "preferences": "files", "prompts": "files"}
TOKENIZED = ("text", "instructions", "preferences", "prompts")

# The flat keys of before the parts, and their places now. The files of text data moved
# to the part of their kind (`migrated` tells which from the old flags).
MOVED = {
    "name": "tfds.name", "train_split": "tfds.train_split", "eval_split": "tfds.eval_split",
    "files": "tfrecords.files", "eval_files": "tfrecords.eval_files",
    "features": "tfrecords.features",
    "text_files": "text.files", "eval_text_files": "text.eval_files", "text_field": "text.field",
    "document_masks": "text.document_masks",
    "tokenizer": "tokens.tokenizer", "vocabulary": "tokens.vocabulary", "merges": "tokens.merges",
    "context_length": "tokens.context_length", "token_counts": "tokens.counts",
    "token_counts_wait_seconds": "tokens.counts_wait_seconds",
    "truncate": "instructions.truncate", "response_field": "instructions.response_field",
    "prompt_field": "instructions.prompt_field",
    "chosen_field": "preferences.chosen_field", "rejected_field": "preferences.rejected_field",
}
_SWITCHES = {  # bools of before: the kind is now the part whose files are set
    "instructions": "set data.instructions.files (and data.instructions.eval_files) to the "
                    ".jsonl globs of prompts and responses",
    "preferences": "set data.preferences.files (and data.preferences.eval_files) to the "
                   ".jsonl globs of preference pairs",
}


def moved(key: str) -> str:
    """The one-line message for `data.KEY` of the flat section, or '' for any other key."""
    if key in _SWITCHES:
        return (f"data.{key} is a part of the data section now, not a switch: "
                f"{_SWITCHES[key]} (docs/data.md, \"The data section\")")
    if key not in MOVED:
        return ""
    also = {"text_files": "; instruction data: data.instructions.files; preference pairs: "
                          "data.preferences.files",
            "eval_text_files": "; instruction data: data.instructions.eval_files; preference "
                               "pairs: data.preferences.eval_files",
            "prompt_field": "; preference pairs: data.preferences.prompt_field"}.get(key, "")
    return f"data.{key} moved to data.{MOVED[key]}{also} (docs/data.md, \"The data section\")"


def migrated(flat: dict) -> dict:
    """A data section as a run before the parts wrote it (config.json), in parts."""
    flat = dict(flat)
    kind = "instructions" if flat.pop("instructions", False) else \
        "preferences" if flat.pop("preferences", False) else "text"
    parts = {}
    for key in list(flat):
        if key not in MOVED:
            continue
        part, name = MOVED[key].split(".")
        if key in ("text_files", "eval_text_files"):
            part = kind
        elif key == "prompt_field" and kind == "preferences":
            part = "preferences"
        parts.setdefault(part, {})[name] = flat.pop(key)
    for part, values in parts.items():
        flat[part] = {**flat.get(part, {}), **values}
    return flat


def kind(data) -> str:
    """The kind of data the section reads (one of KINDS), or '' when it names none.
    Text from a TFDS dataset (`data.tfds.name` with `data.text.field`) is 'text'. A flat
    key of before is its one-line error here too, for a section no config check has seen
    (`tpu_keras.data.build` from the user's code)."""
    for key, value in data.items():
        if key in MOVED or (key in _SWITCHES and not isinstance(value, (dict, ml_collections.ConfigDict))):
            raise UserError(moved(key))
    named = [k for k in KINDS if data[k][WHERE[k]]]
    if named == ["tfds"] and data.text.field:
        return "text"
    if len(named) > 1:
        raise UserError("the data section names several kinds of data ("
                        + ", ".join(f"data.{k}.{WHERE[k]}" for k in named)
                        + "); set one, and leave the other parts at their defaults")
    return named[0] if named else ""


def tokenized(data) -> bool:
    """Text of any kind: documents, instructions or preference pairs, read by a tokenizer."""
    return kind(data) in TOKENIZED


def parts_read(data) -> tuple[str, ...]:
    """The parts a run with this section reads."""
    what = kind(data)
    parts = {"": (), "tfds": ("tfds",), "tfrecords": ("tfrecords",)}.get(what, (what, "tokens"))
    if what == "text" and data.tfds.name:
        parts += ("tfds",)
    return parts


def check(data, defaults) -> None:
    """One line for a part the run does not read that is set anyway: its keys would be
    silently ignored."""
    what = kind(data)
    if not what:
        return  # a template that names no files yet (the command line gives them): no run reads it
    read = parts_read(data)
    for part in (*KINDS, "tokens"):
        if part in read:
            continue
        changed = [key for key, value in data[part].items() if differs(value, defaults[part][key])]
        if changed:
            raise UserError(f"data.{part}.{changed[0]} is set, but this run reads data.{what}, so "
                            f"data.{part} would be ignored; drop it, or "
                            + (f"set data.{part}.{WHERE[part]} to read that kind of data instead"
                               if part in WHERE else "read text, instructions, preferences or prompts"))


def differs(value, default) -> bool:
    """Whether a config value is not its default, compared as JSON would hold them."""
    return _plain(value) != _plain(default)


def _plain(value):
    """A value as JSON would hold it: a ConfigDict as a dict, a tuple as a list."""
    if isinstance(value, ml_collections.ConfigDict):
        return value.to_dict()
    return list(value) if isinstance(value, (tuple, list)) else value
