"""The config schema: every section and key a run may set, with its default.

Config files under `configs/` start from `defaults()` and change values;
`check()` then rejects any key the schema does not know, naming the closest
one, so a typo never silently falls back to a default. The `model` section is
free-form here and checked against the chosen builder's arguments instead.
"""

# Imported inside functions: TensorFlow (the engine must be selected first: engine.select).
import contextlib
import copy
import json
import math
import os

import ml_collections

from tpu_keras import data_section, workdir as workdir_lib
from tpu_keras.cluster import engine
from tpu_keras.cluster.record import STRATEGIES
from tpu_keras.errors import UserError, closest
from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.parallelism.rules import refuse_across_slices, rules_from_pairs

NONFINITE_POLICIES = ("stop", "restore_and_skip")
# What the backward pass recomputes instead of keeping, cheapest first. 'activations' (a
# keras.RematScope mode): the outputs of activation functions (an MLP's wide hidden layer,
# after GELU). 'blocks' (models.block_remat): each transformer block whole, its fsdp-gathered
# weights too. Keras 3.15's 'full' mode fails on both engines for layers called with keyword
# arguments (docs/design.md), so it is not offered.
REMAT_MODES = ("none", "activations", "blocks")
# DIR/export/: the SavedModel, a keras-hub preset, a transformers folder, LoRA factors (keras-hub's
# file, a PEFT adapter).
EXPORT_FORMATS = ("saved_model", "keras_hub", "transformers", "lora", "peft")
# 'auto' is bf16 on TPU and float32 elsewhere (tpu_keras.training.auto_values).
PRECISIONS = ("auto", "float32", "mixed_bfloat16")
# How GRPO averages its token losses (TRL's loss_type; tpu_keras.models.grpo).
GRPO_LOSS_TYPES = ("dapo", "grpo", "dr_grpo")


_TYPE_CHECKS = [True]  # off only inside `without_type_checks()`


def defaults() -> ml_collections.ConfigDict:
    """The full schema. Each config file overrides what it needs."""
    config = ml_collections.ConfigDict(type_safe=_TYPE_CHECKS[-1])
    # Seeds the weights' initialisation and the training data's order.
    config.seed = 0
    # TensorFlow op determinism: the same run gives the same weights, bit for bit,
    # whether it ran through or was killed and resumed. Slower; tf engine.
    config.deterministic = False
    # Keras 3 on TensorFlow ('tf', tf.distribute) or on JAX ('jax', keras.distribution).
    config.engine = "tf"

    # Devices as a (data, fsdp, expert, context, model) grid; all but data need the jax engine.
    # -1: the devices the other axes leave (docs/parallelism.md).
    config.mesh = dict(
        # TPU slices joined by the data-center network (multislice, jax engine): data
        # parallel across them, data x fsdp x expert x context x model inside each
        # (docs/running_on_a_tpu_pod.md, "Several slices").
        slices=1,
        data=-1,  # splits the batch
        # Splits the batch, and every weight of layout.replicate_below elements or more
        # (fully-sharded data parallelism).
        fsdp=1,
        # Splits the batch, and a mixture of experts' experts by the family's layout rules
        # (expert parallelism: each device holds experts / expert of them).
        expert=1,
        # Splits each sequence's tokens (context parallelism: attention gathers the keys and
        # values along it; a language model's context_length must divide by it).
        context=1,
        model=1,  # splits weights by the builder's layout rules (tensor parallelism)
    )

    # Where each weight lives on the mesh (docs/parallelism.md, "Layout rules").
    config.layout = dict(
        # Replace the builder's layout rules when set: ((regex, (axis or None, ...)), ...).
        rules=(),
        extra_rules=(),  # added to the builder's rules (or to `rules`), in the same form
        # Weights this large (elements) must match a rule when mesh.model > 1, and are
        # split over fsdp when mesh.fsdp > 1.
        replicate_below=65_536,
        # Under fsdp alone (mesh.model 1), a keras-hub causal LM's logits are computed split
        # over the vocabulary: each device gathers the step's last hidden states, not the
        # output head (models.vocabulary_split; for steps of fewer tokens than the
        # vocabulary, as in fine-tuning).
        split_logits=False,
        # With mesh.model > 1, each transformer block's output (the residual stream) is held
        # split along the sequence over model (Megatron's sequence parallelism,
        # models.sequence_parallel): a device keeps its share of each block's input, not a copy.
        sequence_parallel=False,
    )

    # Where to run (docs/running_on_a_tpu_pod.md, "Clusters").
    config.cluster = dict(
        strategy="auto",      # auto | tpu | multi_worker | mirrored | one_device
        tpu="",               # TPU name, or 'local' on a TPU VM
        zone="",              # the TPU's zone, where its name alone does not find it
        project="",           # the TPU's Google Cloud project, likewise
        virtual_devices=0,    # >1 splits the CPU into that many replicas
    )

    # What to read: one part, by kind (tpu_keras.data_section, docs/data.md). The keys at the
    # top apply to every kind; a part the run does not read is refused if set.
    config.data = dict(
        data_dir="~/tensorflow_datasets",  # TFDS datasets; '{data_dir}' in a path stands for it
        preprocess="",        # see tpu_keras.data.preprocess.PREPROCESSORS
        inputs="x",           # feature names used by preprocess='features'
        targets="y",          # label feature names used by preprocess='features'
        shuffle_buffer=10_000,  # examples shuffled together (in memory)
        cache=False,          # keep each host's decoded examples in memory
        deterministic=True,   # False lets tf.data reorder for speed
        service_address="",   # a tf.data service dispatcher, e.g. grpc://host:5050
        log_example_ids=False,  # append each training batch's example ids to DIR/example_ids/
        # A TFDS dataset (ours are prepared offline on first use).
        tfds=dict(
            name="",               # e.g. 'mnist', 'stdlib_bytes/ctx128'
            train_split="train",   # splits take slices: 'train[:90%]'
            eval_split="validation",  # the split validation reads
        ),
        # TFRecord files of tf.train.Examples.
        tfrecords=dict(
            files="",              # a glob of the training files
            eval_files="",         # a glob of the evaluation files
            features={},           # the feature spec, such as {'x': 'float32[4]'}
        ),
        # Plain text, tokenized and packed (tpu_keras.data.text).
        text=dict(
            # A glob of .txt files (a document each) or .jsonl files (a document per line,
            # under `field`); empty with data.tfds.name: that dataset's text feature `field`.
            files="",
            eval_files="",         # the same, for evaluation
            field="",              # the text's key in a .jsonl line or a TFDS example
            # Documents packed apart (tpu_keras.data.packing), each attending to itself
            # alone; False: one stream.
            document_masks=False,
        ),
        # Instruction data: each .jsonl line a prompt and a response; the loss and the metrics
        # count the response's tokens alone (tpu_keras.data.documents), each example packed
        # apart.
        instructions=dict(
            files="",              # a glob of .jsonl files
            eval_files="",         # the same, for evaluation
            prompt_field="prompt",  # the prompt's key in a line
            response_field="response",  # the response's key in a line
            # An example longer than a row is cut to it (its end token lost); False: a
            # one-line error naming its file and line.
            truncate=False,
        ),
        # Preference pairs for DPO: each .jsonl line a prompt, a chosen and a rejected
        # response (tpu_keras.data.preferences); the loss is DPO's (dpo.beta).
        preferences=dict(
            files="",              # a glob of .jsonl files
            eval_files="",         # the same, for evaluation
            prompt_field="prompt",  # the prompt's key in a line
            chosen_field="chosen",  # the preferred response's key
            rejected_field="rejected",  # the other response's key
        ),
        # Prompts for GRPO: each .jsonl line a prompt that the policy completes inside the
        # run; the line's other fields go to the reward functions (grpo.rewards) beside the
        # prompts and completions (docs/fine_tuning.md, "GRPO").
        prompts=dict(
            files="",              # a glob of .jsonl files
            eval_files="",         # the same, for evaluation
            prompt_field="prompt",  # the prompt's key in a line
        ),
        # How text, instructions and preferences become tokens.
        tokens=dict(
            # 'bytes' | a keras_hub tokenizer class with its vocabulary file (a SentencePiece
            # proto; a BPE vocab.json with merges) | 'preset': model.preset's tokenizer.
            tokenizer="bytes",
            vocabulary="",         # the tokenizer's file: a SentencePiece proto, a vocab.json
            merges="",             # a byte-pair tokenizer's merges.txt
            context_length=0,  # packed sequences hold context_length + 1 tokens; 0: model's
            # Where each file's token count is kept, made once and read by every host and
            # restart (tpu_keras.data.token_counts); empty: DIR/token_counts.
            counts="",
            # How long a host waits without any new count arriving before it stops with an
            # error naming the host and file it waited for (a host that died while counting).
            counts_wait_seconds=3600.0,
        ),
    )

    # Which builder (tpu_keras.models.REGISTRY) and its keyword arguments: free-form,
    # checked against the builder's own (docs/models.md).
    config.model = dict(
        name="",              # 'gpt', 'mlp', 'cnn', 'keras_hub:Llama3CausalLM', ...
    )

    # How the model trains.
    config.train = dict(
        batch_size=64,        # global: split evenly over all replicas
        # Micro-batches of batch_size whose mean gradient makes one update (a larger
        # batch than memory holds). steps, the schedule, logs and checkpoints count updates.
        grad_accum_steps=1,
        steps=1000,           # updates in all
        optimizer="adamw",    # any keras.optimizers name
        learning_rate=1e-3,   # peak, reached after warmup_steps
        warmup_steps=100,     # linear warmup from 0 to learning_rate
        min_learning_rate_ratio=0.1,  # cosine decays to this fraction of the peak
        weight_decay=0.01,    # for adamw, adam, lion and sgd; 0: none
        clipnorm=1.0,         # clips the global gradient norm; 0: no clipping
        eval_every=200,       # steps between validations
        eval_steps=0,         # 0: the whole eval split
        steps_per_execution=0,  # steps per execution; 0: auto (TPU: the log interval, else 10)
        jit_compile=False,    # XLA on the tf engine; the jax engine and TPUs always compile
        precision="auto",     # 'float32' | 'mixed_bfloat16'; auto: bf16 on TPU, else float32
        remat="none",         # 'activations' | 'blocks': what the backward pass recomputes
        # A causal LM's output head and loss over this many pieces of the sequence, one at a
        # time, each recomputed in the backward pass: one piece's logits in memory (models.chunked_loss)
        loss_chunks=1,
        # A NaN/Inf loss: 'stop' (keep the last good checkpoint), or 'restore_and_skip'
        # (reload it and leave out the batch that diverged, at most max_nonfinite_skips times).
        on_nonfinite="stop",
        max_nonfinite_skips=3,  # batches left out at most, before the run stops
        # Compiled steps reused across processes (tpu_keras.training.compile_cache): 'auto'
        # is ~/.cache/tpu_keras/compile_cache, or WORKDIR/compile_cache on gs://; a folder;
        # '' or 'off'.
        compile_cache="auto",
        # What the run trains the model for (tpu_keras.objectives): 'sft', 'dpo', 'grpo' or
        # one that model.imports registers; auto: dpo on data.preferences, grpo on
        # data.prompts, else sft.
        objective="auto",
    )

    # DPO (train.objective 'dpo'; data.preferences): the policy learns to prefer each
    # pair's chosen response over its rejected one (tpu_keras.objectives.dpo).
    config.dpo = dict(
        # How strongly the policy is held to the reference, the model as training started
        # (TRL's beta).
        beta=0.1,
    )

    # GRPO (train.objective 'grpo'; data.prompts): the policy samples a group of
    # completions of each prompt, reward functions score them, and each completion's
    # advantage is its reward against its group's (tpu_keras.objectives.grpo). The names
    # are TRL's GRPOConfig's, with its meanings.
    config.grpo = dict(
        num_generations=8,          # G: completions per prompt; train.batch_size counts completions
        max_completion_length=64,   # new tokens per completion, its stop token included
        temperature=1.0,            # sampling, and the log-probabilities the loss compares
        top_p=1.0,                  # nucleus sampling; 1: the whole vocabulary
        stop="",                    # text of one token that ends a completion, besides the end token
        # 'module:function' or 'file.py:function' names: fn(prompts=, completions=, **fields)
        # returns one float per completion; their weighted sum is the reward.
        rewards=(),
        reward_weights=(),          # one per reward function; (): 1 each
        scale_rewards=True,         # divide by the group's std; False: Dr.GRPO
        epsilon=0.2,                # the ratio's clip range below 1 (and above, unless epsilon_high)
        epsilon_high=0.0,           # the range above 1; 0: epsilon (DAPO's clip-higher: 0.28)
        beta=0.0,                   # the KL term's weight; 0: no reference model is held
        loss_type="dapo",           # 'dapo' | 'grpo' | 'dr_grpo': how the token losses are averaged
        num_iterations=1,           # optimisation steps on each batch of samples
        # Write each batch's prompts, completions, rewards and advantages to
        # DIR/completions/BATCH-hostH.jsonl (TRL logs them as a table).
        log_completions=False,
    )

    # Checkpoints in DIR/checkpoints, from which the same command resumes (docs/reliability.md).
    config.checkpoint = dict(
        every_steps=200,      # steps between saves (and one at the end)
        keep=3,               # the latest saves kept
        # Write checkpoints on a background thread while training goes on: the loop blocks
        # only to copy the state into host memory (docs/reliability.md). False: every save
        # is written and committed before the next step.
        asynchronous=True,
    )

    # What the run leaves in DIR/export/ (tpu_keras.models.export).
    config.export = dict(
        # Any of saved_model, keras_hub, transformers, lora, peft; () is every one that
        # applies (a keras-hub task: all of them; any other model: saved_model).
        formats=(),
    )

    # What the run reports as it goes.
    config.log = dict(
        every_steps=50,       # one log line, and TensorBoard scalars, per interval
        # (first, last): a TensorBoard profile of these steps (1-based, whole
        # executions, train.steps_per_execution) in DIR/tensorboard; () is off.
        profile_steps=(),
    )
    return config


def check(config: ml_collections.ConfigDict) -> None:
    """Raises a one-line UserError for unknown keys, values out of range or inconsistent
    intervals: everything that can be told before TensorFlow loads."""
    _check_keys(config, defaults(), "")
    engine.check_name(config.engine)
    _check_ranges(config)
    strategy = config.cluster.strategy
    if strategy not in STRATEGIES:
        raise UserError(f"cluster.strategy={strategy!r} is not one of {STRATEGIES}"
                        f"{closest(strategy, STRATEGIES)}")
    mesh = mesh_lib.check(config.mesh, config.engine)  # against the devices: when the cluster connects
    for key in ("rules", "extra_rules"):
        for rule in config.layout[key]:
            if (not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str)
                    or isinstance(rule[1], str)):
                raise UserError(f"layout.{key} entry {rule!r} is not a (regex, axes) pair such as "
                                "(r'dense\\d+/kernel', (None, 'model'))")
            refuse_across_slices(rules_from_pairs([rule])[0], mesh)
    fsdp, model = config.mesh.get("fsdp", 1), config.mesh.get("model", 1)
    if config.layout.split_logits and (fsdp == 1 or model != 1):
        raise UserError(f"layout.split_logits splits a causal LM's logits over fsdp where fsdp alone "
                        f"splits its output head, and this mesh has fsdp={fsdp}, model={model}: set "
                        "mesh.fsdp above 1 and mesh.model=1, or leave layout.split_logits False (a "
                        "model axis splits the head already)")
    for name in config.export.formats:
        if name not in EXPORT_FORMATS:
            raise UserError(f"export.formats has {name!r}, which is not one of {EXPORT_FORMATS}"
                            f"{closest(str(name), EXPORT_FORMATS)}")
    train, log = config.train, config.log
    data_section.check(config.data, defaults().data)
    if train.precision not in PRECISIONS:
        raise UserError(f"train.precision={train.precision!r} is not one of "
                        f"{', '.join(map(repr, PRECISIONS))}{closest(train.precision, PRECISIONS)}")
    if train.remat not in REMAT_MODES:
        raise UserError(f"train.remat={train.remat!r} is not one of "
                        f"{', '.join(map(repr, REMAT_MODES))}{closest(train.remat, REMAT_MODES)}")
    length = config.model.get("context_length", 0)
    context = config.mesh.get("context", 1)
    if context > 1 and not length:
        raise UserError(f"mesh.context={context} splits a language model's sequences, and model "
                        f"{config.model.get('name')!r} has no model.context_length; drop mesh.context")
    if context > 1 and length % context:
        raise UserError(f"mesh.context={context} does not divide the sequence's {length} tokens "
                        "(model.context_length); pick a divisor of it")
    if config.layout.sequence_parallel:
        model = config.mesh.get("model", 1)
        if model == 1 or not length:
            raise UserError("layout.sequence_parallel splits a language model's sequences over "
                            f"mesh.model, and this run has mesh.model={model}"
                            + ("" if length else f" and model {config.model.get('name')!r} no "
                               "model.context_length") + ": set mesh.model above 1 (jax engine) "
                            "or leave layout.sequence_parallel False")
        if length % (context * model):
            raise UserError(f"layout.sequence_parallel splits each sequence's {length} tokens "
                            f"(model.context_length) over context x model = {context * model} "
                            "devices, which does not divide them; pick sizes that do")
    if train.loss_chunks > 1 and length and length % train.loss_chunks:
        raise UserError(f"train.loss_chunks={train.loss_chunks} does not divide the sequence's "
                        f"{length} tokens (model.context_length); pick a divisor of it")
    if train.on_nonfinite not in NONFINITE_POLICIES:
        raise UserError(f"train.on_nonfinite={train.on_nonfinite!r} is not one of "
                        f"{NONFINITE_POLICIES}{closest(train.on_nonfinite, NONFINITE_POLICIES)}")
    for name, every in (("train.eval_every", train.eval_every),
                        ("checkpoint.every_steps", config.checkpoint.every_steps)):
        if every % log.every_steps:
            raise UserError(f"{name}={every} must be a multiple of log.every_steps={log.every_steps}")
    if train.steps_per_execution and log.every_steps % train.steps_per_execution:
        raise UserError(f"log.every_steps={log.every_steps} must be a multiple of "
                        f"train.steps_per_execution={train.steps_per_execution}")
    profile = tuple(log.profile_steps)
    if profile and (len(profile) != 2 or not all(isinstance(s, int) for s in profile)
                    or not 1 <= profile[0] <= profile[1]):
        raise UserError(f"log.profile_steps={profile!r} is not a (first, last) pair of steps with "
                        "1 <= first <= last, such as (101, 110); use () for no profile")
    if train.steps % log.every_steps:
        raise UserError(f"train.steps={train.steps} must be a multiple of "
                        f"log.every_steps={log.every_steps}")


def read_run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a run in `workdir` wrote to its config.json (the run's resolved config:
    `training.run_config`), over today's defaults for keys an older run did not write;
    or a one-line error."""
    path = os.path.join(workdir, "config.json")
    if workdir_lib.is_remote(workdir):  # gs://: TensorFlow reads it (and brings Keras on its own backend)
        import tensorflow as tf
        exists, opener = tf.io.gfile.exists, tf.io.gfile.GFile
    else:  # read before Keras loads, so that the engine can still be chosen
        exists, opener = os.path.exists, open
    if not exists(path):
        raise UserError(f"{workdir} holds no training run (no config.json); give the --workdir "
                        "of a run of python -m tpu_keras.train")
    with opener(path) as file, without_type_checks():
        config = defaults()  # JSON has lists where the schema has tuples
        written = json.load(file)
        if any(key in data_section.MOVED for key in written.get("data", {})):
            written["data"] = data_section.migrated(written["data"])  # a run before the parts
        for path, place in MOVED_KEYS.items():  # a run before its key moved
            (section, key), (new_section, new_key) = path.split("."), place.split(".")
            if key in written.get(section, {}):
                written.setdefault(new_section, {})[new_key] = written[section].pop(key)
        config.update(written)
    return config


def thawed(config) -> ml_collections.ConfigDict:
    """A copy of `config` that can be changed, from a frozen one (a run's resolved config:
    `training.run_config`) too."""
    if isinstance(config, ml_collections.FrozenConfigDict):
        return config.as_configdict()
    return copy.deepcopy(config)


@contextlib.contextmanager
def without_type_checks():
    """`defaults()` gives configs that take a value of any type, so that a config file
    that sets a wrong one can be loaded, and `check_types` can name the key."""
    _TYPE_CHECKS.append(False)
    try:
        yield
    finally:
        _TYPE_CHECKS.pop()


def check_types(config, schema=None, prefix: str = "") -> None:
    """A one-line error for the first value whose type is not its default's."""
    schema = defaults() if schema is None else schema
    for key, value in config.items():
        path = f"{prefix}{key}"
        if key not in schema or path in _FREE_FORM:
            continue
        expected = schema[key]
        if isinstance(expected, ml_collections.ConfigDict):
            if not isinstance(value, (dict, ml_collections.ConfigDict)):
                raise UserError(section_given_a_value(path, value, expected))
            check_types(value, expected, f"{path}.")
        elif not _same_kind(value, expected):
            raise UserError(f"{path} takes {a_type(type(expected))}, not the "
                            f"{type(value).__name__} {value!r}; set it to {a_type(type(expected))}"
                            f" such as {expected!r}")


def section_given_a_value(path: str, value, section) -> str:
    """The message for `path=value` where `path` is a section (a flat key of before, or a
    section's own name)."""
    if path.startswith("data.") and data_section.moved(path[len("data."):]):
        return data_section.moved(path[len("data."):])
    keys = ", ".join(f"{path}.{k}" for k in section.keys())
    return f"{path}={value!r}: {path} is a section, not a value; set its keys ({keys})"


def _same_kind(value, expected) -> bool:
    if isinstance(expected, bool) or isinstance(value, bool):
        return isinstance(value, bool) == isinstance(expected, bool)
    if isinstance(expected, float):
        return isinstance(value, (int, float))
    if isinstance(expected, (tuple, list)):
        return isinstance(value, (tuple, list))
    return expected is None or isinstance(value, type(expected))


def a_type(kind: type) -> str:
    """'an int', 'a float', 'a tuple': a type's name as a sentence says it."""
    name = kind.__name__
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


# (key, lowest, highest or None): counts, intervals and rates. Checked before the
# interval checks in `check()`, which would divide by zero.
_RANGES = (
    ("train.batch_size", 1, None), ("train.grad_accum_steps", 1, None), ("train.steps", 1, None), ("train.learning_rate", 0, None),
    ("train.loss_chunks", 1, None),
    ("train.warmup_steps", 0, None), ("train.min_learning_rate_ratio", 0, 1),
    ("train.weight_decay", 0, None), ("train.clipnorm", 0, None), ("train.eval_every", 1, None),
    ("train.eval_steps", 0, None), ("train.steps_per_execution", 0, None),
    ("checkpoint.every_steps", 1, None), ("checkpoint.keep", 1, None), ("log.every_steps", 1, None),
    ("cluster.virtual_devices", 0, None), ("data.shuffle_buffer", 1, None),
    ("data.tokens.context_length", 0, None),
    ("layout.replicate_below", 0, None),
    ("grpo.max_completion_length", 1, None), ("grpo.temperature", 0, None),
    ("grpo.epsilon", 0, 1), ("grpo.epsilon_high", 0, None), ("grpo.beta", 0, None),
    ("grpo.num_iterations", 1, None),
)


def _check_ranges(config):
    for key, low, high in _RANGES:
        value = config
        for name in key.split("."):
            value = value[name]
        wanted = f"a number from {low} to {high}" if high is not None else f"{low} or more"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{key}={value!r} is not a number; set {key} to {wanted}")
        if not math.isfinite(value) or value < low or (high is not None and value > high):
            raise UserError(f"{key}={value!r} is out of range; set {key} to {wanted}")


# Sections whose keys are not fixed by the schema: a builder's arguments, a feature spec.
_FREE_FORM = ("model", "data.tfrecords.features")


# Keys of before that moved to another section: path -> its new path.
MOVED_KEYS = {"train.dpo_beta": "dpo.beta"}


def _check_keys(config, schema, prefix):
    for key, value in config.items():
        path = f"{prefix}{key}"
        if path in MOVED_KEYS:
            raise UserError(f"{path} moved to {MOVED_KEYS[path]} (its objective's section): set "
                            f"{MOVED_KEYS[path]}={value!r} instead")
        if key not in schema and prefix == "data." and data_section.moved(key):
            raise UserError(data_section.moved(key))
        if key not in schema:
            raise UserError(f"unknown config key {path!r}{closest(key, schema.keys())}")
        if path not in _FREE_FORM and isinstance(schema[key], ml_collections.ConfigDict):
            _check_keys(value, schema[key], f"{path}.")
