"""Text from a language model, a run's newest checkpoint or a keras-hub preset, with keras-hub's samplers.

`from_run(workdir)` rebuilds a run's model from its `config.json` on this
machine's first device, restores the newest checkpoint into it (the
checkpoint's own engine: TensorFlow's or Orbax's format) and pairs it
with the run's tokenizer (`data.tokens.tokenizer`: bytes, a keras-hub tokenizer
or the preset's); `from_preset(path)` reads any keras-hub preset folder
with its tokenizer, a transformers checkpoint folder too (read as a run reads
`model.preset`: `models.hub_presets`, the family's keys that keras-hub's
converter drops passed through). Either gives a `Generator`: prompts in, texts out,
each stopping at the tokenizer's end token.

keras-hub causal LMs generate through keras-hub itself: with the family's
own tokenizer through `CausalLM.generate` and its preprocessor (so greedy
text equals keras-hub's on the same weights), with any other tokenizer
through `generate` on token ids. The `gpt` builder, which has no cache,
calls the same samplers on its logits over the whole padded sequence at
each step: the prefix is recomputed, fine for checking a run, not a
serving path.

Keras, keras-hub and TensorFlow are imported inside the functions:
`python -m tpu_keras.generate` imports this module before it selects the engine.
"""

# Imported inside functions: Keras and TensorFlow (the engine must be selected first:
# engine.select); keras-hub (optional: absent on a plain install); NumPy (start-up time:
# not every caller needs it).
import dataclasses
import types
from typing import Callable

from tpu_keras import data_section
from tpu_keras.errors import UserError, first_line
from tpu_keras.training import restored

LM_HEADLINES = ("bits_per_byte", "bits_per_token")


@dataclasses.dataclass
class Generator:
    context: int                               # the most tokens, prompt included
    encode: Callable[[str], list]              # the token ids the model is given for a prompt
    generate: Callable[[list, int, object], list]  # (prompts, max_length, sampler) -> texts
    step: int = -1                             # the checkpoint's step (-1: a preset)
    model: object = None                       # what it samples from (a keras-hub task, or the run's model)
    vocabulary: int = 0                        # the ids its tokenizer has pieces for (0: every id)

    def count(self, prompt: str) -> int:
        """The tokens a prompt takes, a start token included."""
        return len(self.encode(prompt))


def load(workdir: str, config):
    """(run, step): the run set up on one device (`training.setup.RunSetup`: its model, its
    resolved config), its newest checkpoint restored."""
    from tpu_keras import models

    builder, _ = models.registry.get(config.model)
    if builder.headline not in LM_HEADLINES:
        raise UserError(f"the run in {workdir} trained {config.model.name!r}, which is not a "
                        "language model; generate needs a run of gpt or a keras-hub causal LM")
    return restored.load(workdir, config, purpose="generate")


def from_run(workdir: str, config) -> Generator:
    """The run's model and tokenizer (`data.tokens.tokenizer`; bytes for byte-level data)."""
    from tpu_keras.data import preferences, text, tokenizers
    run, step = load(workdir, config)
    from tpu_keras.models import export, preference
    model, config = preference.policy_of(run.model), run.config  # a DPO run's language model
    # (and data.tokens.tokenizer='preset': the resolved preset's)
    kind = data_section.kind(config.data)
    tokenized = kind in data_section.TOKENIZED
    tokens = text.with_data_dir(config.data).tokens if tokenized else types.SimpleNamespace(
        tokenizer=tokenizers.BYTES)  # byte windows (stdlib_bytes): each byte a token
    tokenizer = tokenizers.make(tokens)
    # A prompt starts as training started one: instruction data puts the start token first.
    recipe = preferences.prompt_recipe(config.data)
    start = recipe.prompt_start(tokenizer) if tokenized else []
    context = model.input_shape[1]
    task = export.find_task(model)  # nested where the run packed examples apart
    if task is None:
        generator = _ids_generator(tokenizer, start, context, _whole_sequence(model, context))
    else:
        preprocessor_cls = task.preprocessor_cls
        if preprocessor_cls is not None and isinstance(tokenizer.layer,
                                                        preprocessor_cls.tokenizer_cls):
            task.preprocessor = preprocessor_cls(tokenizer=tokenizer.layer, sequence_length=context,
                                                 add_start_token=bool(start))
            generator = _task_generator(task, context)
        else:
            generator = _ids_generator(tokenizer, start, context, _task_on_ids(task))
    generator.step, generator.model, generator.vocabulary = step, model, tokenizer.vocabulary_size
    return generator


def from_preset(path: str) -> Generator:
    """A keras-hub causal LM of a preset folder (`save_to_preset`'s, or a transformers
    checkpoint's) with its tokenizer, built as a run builds `model.preset`."""
    import keras_hub
    from keras_hub.src.utils.preset_utils import find_subclass
    from tpu_keras.models import hub_presets, segments
    try:
        backbone_cls, _ = hub_presets.saved_backbone(path)
        # The backbone's own causal LM (Gemma4CausalLM, not the Gemma4AssistantCausalLM that
        # keras-hub 0.32's `find_subclass` may find first), else keras-hub's pick.
        task_cls = getattr(keras_hub.models, backbone_cls.__name__.replace("Backbone", "CausalLM"),
                           None) or find_subclass(path, keras_hub.models.CausalLM, backbone_cls)
        backbone = hub_presets.load_backbone(backbone_cls, path)
        preprocessor = hub_presets.load_tokenizer(path, task_cls.preprocessor_cls)
    except UserError as error:
        raise UserError(str(error).replace("model.preset=", "--preset=")) from None
    except (ValueError, FileNotFoundError, OSError) as error:
        raise UserError(f"--preset={path!r} is not a causal LM preset with a tokenizer "
                        f"({first_line(error, 160)}); give a folder that CausalLM.save_to_preset "
                        "or transformers' save_pretrained wrote") from None
    segments.route_delta_nets(backbone)  # Qwen 3.5's linear attention, as a run computes it
    task = task_cls(backbone=backbone, preprocessor=preprocessor)
    context = task.preprocessor.sequence_length
    limit = getattr(task.backbone, "max_sequence_length", None)
    generator = _task_generator(task, min(context, limit) if limit else context)
    generator.model, generator.vocabulary = task, int(task.preprocessor.tokenizer.vocabulary_size())
    return generator


def make_sampler(temperature: float, top_k: int, seed: int, vocabulary: int = 0):
    """keras-hub's sampler for these settings, never drawing an id past `vocabulary` (0: any)."""
    import keras_hub
    if temperature == 0:
        sampler = keras_hub.samplers.GreedySampler()
    elif top_k:
        sampler = keras_hub.samplers.TopKSampler(k=top_k, temperature=temperature, seed=seed)
    else:
        sampler = keras_hub.samplers.RandomSampler(temperature=temperature, seed=seed)
    return within_vocabulary(sampler, vocabulary) if vocabulary else sampler


def within_vocabulary(sampler, size: int):
    """A copy of keras-hub's `sampler` whose logits past the first `size` ids are never drawn.
    Embedding tables are padded past their tokenizer's pieces (Gemma 3's 262,208 rows for
    262,145 pieces); a random draw from an untrained or barely trained row then gave an id
    the tokenizer cannot turn into text (SentencePiece: "piece id is out of range")."""
    import keras

    class WithinVocabulary(type(sampler)):
        def __call__(self, next, *args, **kwargs):  # pylint: disable=redefined-builtin
            def within(*inputs, **named):
                logits, hidden_states, cache = next(*inputs, **named)
                known = keras.ops.arange(logits.shape[-1]) < size
                return keras.ops.where(known, logits, keras.ops.full_like(logits, -1e9)), hidden_states, cache
            return super().__call__(within, *args, **kwargs)

    WithinVocabulary.__name__ = type(sampler).__name__
    return WithinVocabulary.from_config(sampler.get_config())


def _task_generator(task, context: int) -> Generator:
    """keras-hub's own `CausalLM.generate`, its preprocessor tokenizing and detokenizing."""
    import keras
    preprocessor = task.preprocessor

    def encode(prompt):
        inputs = preprocessor.generate_preprocess([prompt])  # as generate gives them the model
        ids, mask = (keras.ops.convert_to_numpy(inputs[key][0]) for key in ("token_ids",
                                                                            "padding_mask"))
        return [int(i) for i in ids[mask.astype(bool)]]

    def generate(prompts, max_length, sampler):
        task.compile(sampler=sampler)
        return [_string(text) for text in task.generate(prompts, max_length=max_length)]
    return Generator(context, encode, generate)


def _ids_generator(tokenizer, start: list, context: int, extend) -> Generator:
    """Prompts tokenized by the run's tokenizer after the `start` ids, `extend` continuing
    their ids, then detokenized (the `start` ids left out of the text).

    `extend(tokens, mask, index, stop_ids, sampler)` returns the sequences with every position
    that `mask` leaves open filled, or stopped after an id of `stop_ids`."""
    import numpy as np
    import tensorflow as tf
    from tpu_keras.data import tokenizers

    def encode(prompt):
        return start + [int(i) for i in tokenizer.tokenize(tf.constant([prompt]))[0].numpy()]

    def generate(prompts, max_length, sampler):
        encoded = [encode(prompt) for prompt in prompts]
        # The open positions must not read as end tokens: keras-hub's samplers stop on any.
        tokens = np.full((len(prompts), max_length), int(tokenizer.eos_id == 0), "int32")
        given = np.zeros((len(prompts), max_length), bool)
        for row, ids in enumerate(encoded):
            tokens[row, :len(ids)], given[row, :len(ids)] = ids, True
        out = extend(tokens, given, min(len(ids) for ids in encoded), [tokenizer.eos_id], sampler)
        texts = []
        for ids, row in zip(encoded, out):
            new = [int(t) for t in row[len(ids):]]
            if tokenizer.eos_id in new:
                new = new[:new.index(tokenizer.eos_id)]
            texts.append(tokenizers.decode(tokenizer, ids[len(start):] + new))
        return texts
    return Generator(context, encode, generate)


def _task_on_ids(task):
    """A keras-hub task's `generate` on token ids (its tokenizer is not the family's)."""
    import keras

    def extend(tokens, given, index, stop_ids, sampler):
        del index  # the task finds it from the padding mask
        task.preprocessor = None
        task.compile(sampler=sampler)
        out = task.generate({"token_ids": tokens, "padding_mask": given}, stop_token_ids=stop_ids)
        return keras.ops.convert_to_numpy(out["token_ids"])
    return extend


def _whole_sequence(model, context: int):
    """A keras-hub sampler on a model that maps (batch, context) token ids to logits."""
    import keras

    def extend(tokens, given, index, stop_ids, sampler):
        max_length = tokens.shape[1]

        def next_logits(tokens, cache, index):
            padded = keras.ops.pad(tokens, [[0, 0], [0, context - max_length]])
            logits = model(padded, training=False)
            return keras.ops.take(logits, index - 1, axis=1), None, cache
        out = sampler(next_logits, keras.ops.convert_to_tensor(tokens), index=index,
                      mask=keras.ops.convert_to_tensor(given), stop_token_ids=stop_ids,
                      model=model)
        return keras.ops.convert_to_numpy(out)
    return extend


def _string(value) -> str:
    """keras-hub's detokenized text (a str, bytes or a scalar string tensor) as a str."""
    if hasattr(value, "numpy"):
        value = value.numpy()
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
