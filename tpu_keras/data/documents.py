"""What one document is, in tokens: plain text, or a prompt and its response.

`Text`: a document's tokens, then the tokenizer's end token; every token is
trained on.

`Instructions` (`data.instructions`): each line of a .jsonl file holds
a prompt under `data.instructions.prompt_field` and a response under
`data.instructions.response_field`. Its tokens are the tokenizer's start token (where it
has one: keras-hub tokenizers' `start_token_id`; the byte tokenizer has
none), the prompt's, the response's, then the end token. Prompt and response
are tokenized apart, as a generator sees a prompt alone. Each token carries
a weight: 0 for the start token and the prompt, 1 for the response and its
end token, so the loss and the metrics count the response alone (the
weight of a target is its token's). The prompt is given as it is: write
any template (\"Question: ...\\nAnswer: \") into the prompt field itself.

Both tokenize a block of documents at once, inside tf.data, and say per
document what `text` counts: its tokens, bytes, the tokens and bytes
trained on (bits per byte divide by these) and its prompt's tokens.
"""

import dataclasses
import json

import tensorflow as tf

from tpu_keras.errors import UserError


@dataclasses.dataclass(frozen=True)
class Text:
    field: str = ""  # the key of a .jsonl line's text ('' for .txt files and TFDS)

    @property
    def fields(self) -> dict:
        return {"data.text.field": ("text", self.field)}

    def decode(self, line):
        field = self.field
        text = tf.numpy_function(lambda raw: json.loads(raw)[field].encode("utf-8"),
                                 [line], tf.string, stateful=False)
        return tf.ensure_shape(text, [])

    def prompt_start(self, tokenizer) -> list:
        """The tokens a document starts with before its own: none (packed text)."""
        return []

    def tokenize(self, tokenizer, texts):
        """(tokens, weights or None, prompt tokens) of a block of documents: ragged."""
        tokens = _concat([tokenizer.tokenize(texts), column(texts, tokenizer.eos_id)])
        return tokens, None, tf.zeros_like(tokens.row_lengths())

    def sizes(self, texts):
        """(bytes, bytes trained on) of each document."""
        size = tf.strings.length(texts)
        return size, size


@dataclasses.dataclass(frozen=True)
class Instructions:
    prompt_field: str
    response_field: str

    @property
    def fields(self) -> dict:
        return {"data.instructions.prompt_field": ("prompt", self.prompt_field),
                "data.instructions.response_field": ("response", self.response_field)}

    def decode(self, line):
        keys = (self.prompt_field, self.response_field)

        def pair(raw):
            record = json.loads(raw)
            return tuple(record[key].encode("utf-8") for key in keys)
        prompt, response = tf.numpy_function(pair, [line], (tf.string, tf.string), stateful=False)
        return {"prompt": tf.ensure_shape(prompt, []), "response": tf.ensure_shape(response, [])}

    def prompt_start(self, tokenizer) -> list:
        """The tokens before each prompt: the start token, where the tokenizer has one (a
        generator puts them before a prompt too)."""
        return [] if tokenizer.start_id is None else [tokenizer.start_id]

    def tokenize(self, tokenizer, block):
        prompt = tokenizer.tokenize(block["prompt"])
        for token in self.prompt_start(tokenizer):
            prompt = _concat([column(block["prompt"], token), prompt])
        response = _concat([tokenizer.tokenize(block["response"]),
                            column(block["response"], tokenizer.eos_id)])
        weights = _concat([tf.zeros_like(prompt), tf.ones_like(response)])
        return _concat([prompt, response]), weights, prompt.row_lengths()

    def sizes(self, block):
        response = tf.strings.length(block["response"])
        return tf.strings.length(block["prompt"]) + response, response


def column(texts, token: int):
    """One `token` per document, ragged [batch, 1]."""
    return tf.RaggedTensor.from_tensor(tf.fill([tf.shape(texts)[0], 1], token))


def _concat(parts):
    return tf.concat(parts, axis=1)


def check_lines(path: str, recipe) -> int:
    """The lines of a .jsonl file; a one-line error for the first that lacks a field, or
    whose fields the recipe refuses (`preferences.Pairs.problem`)."""
    count = 0
    with tf.io.gfile.GFile(path, "rb") as file:
        for count, line in enumerate(file, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{count} is not a JSON object; write one object per "
                                "line, with no blank lines") from None
            for key, (what, field) in recipe.fields.items():
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    keys = sorted(record) if isinstance(record, dict) else []
                    raise UserError(f"{path}:{count} has no text under {key}={field!r}; set "
                                    f"{key} to the key of the {what} (this line has {keys})")
            problem = recipe.problem(record) if hasattr(recipe, "problem") else ""
            if problem:
                raise UserError(f"{path}:{count} {problem}")
    return count
