"""GRPO's completions, sampled by the policy inside the run: one jitted program over the mesh.

`GroupSampler` repeats each prompt `num_generations` times (a group's rows
next to each other, so a batch split over devices or hosts by rows keeps
groups whole) and continues every row with keras-hub's samplers
(`RandomSampler`, `TopPSampler` for top-p < 1) at the run's temperature:

- a keras-hub causal LM through its own `generate_step` (its KV cache), as
  keras-hub's `CausalLM.generate` runs it;
- the `gpt` builder, which has no cache, through the same sampler on the
  logits of the whole sequence at each step (fine for tests and small models).

The program is the policy's stateless call under `jax.jit`, its weights
passed in as they are laid out (sharded by the run's layout, LoRA factors
included), the rows split over the mesh's batch axes as a training batch is.
It compiles once: every batch has the same shape (the longest prompt of the
run's files and one completion, at most the context), and the random stream
is an input, not a Python value.

The random stream: the sampler's seed state is set, for each batch of
samples, to (`seed`, batch index), so the same run samples the same
completions, whether it ran through or was resumed from a checkpoint.

A row's completion is its tokens after its prompt, up to and including the
first stop token (the tokenizer's end token, or `grpo.stop`), at most
`max_new` tokens; everything after it is padding. keras-hub's sampler stops
once every row has emitted a stop token; rows that ran past their
`max_new` tokens are cut here.
"""

# Imported inside functions: keras-hub (optional: absent on a plain install).
import dataclasses

import jax
import keras
import numpy as np

from tpu_keras.models import export


@dataclasses.dataclass
class Samples:
    """A batch of sampled sequences: [rows, context + 1] tokens (a prompt, its completion,
    then padding), and where each completion lies."""
    tokens: np.ndarray
    prompt_lengths: np.ndarray      # [rows]
    completion_lengths: np.ndarray  # [rows], a stop token included
    stopped: np.ndarray             # [rows] whether the completion ends with a stop token

    def mask(self) -> np.ndarray:
        """[rows, context] float32: 1 on the targets that are completion tokens (target t is
        token t + 1), 0 on the prompt and the padding."""
        position = np.arange(1, self.tokens.shape[1])[None, :]
        start = self.prompt_lengths[:, None]
        return ((position >= start) & (position < start + self.completion_lengths[:, None])
                ).astype("float32")

    def completions(self) -> list:
        """Each row's completion ids, its stop token left out."""
        return [list(row[start:start + length - int(stop)]) for row, start, length, stop
                in zip(self.tokens.tolist(), self.prompt_lengths, self.completion_lengths,
                       self.stopped)]


def make_sampler(temperature: float, top_p: float):
    """keras-hub's sampler for this temperature and top-p (its seed is set per batch)."""
    import keras_hub
    if top_p < 1:
        return keras_hub.samplers.TopPSampler(p=top_p, temperature=temperature, seed=0)
    return keras_hub.samplers.RandomSampler(temperature=temperature, seed=0)


class LogProbs:
    """`log_probs(tokens)`: the policy's per-token log-probabilities of sampled sequences
    ([rows, context + 1] -> [rows, context], this host's rows), from the group model's first
    column in one jitted program over the mesh: the sampling policy's, which a batch trained
    on more than once (`grpo.num_iterations`) holds its ratio to. (Keras's `predict_on_batch`
    returns every host's rows, which one host cannot read off a mesh that spans hosts.)"""

    def __init__(self, model):
        self.model = model
        self._compiled = jax.jit(self._log_probs)

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        values = ([v.value for v in self.model.trainable_variables],
                  [v.value for v in self.model.non_trainable_variables])
        return local_rows(self._compiled(*values, on_the_mesh(tokens)))

    def _log_probs(self, trainable, non_trainable, tokens):
        out, _ = self.model.stateless_call(trainable, non_trainable, tokens, training=False)
        return out[..., 0]


class GroupSampler:
    """`sampler(prompts, seed, index)`: each prompt's group of completions (`Samples`)."""

    def __init__(self, policy, *, num_generations: int, max_new: int, stop_ids, pad_id: int,
                 temperature: float, top_p: float, longest_prompt: int):
        self.policy, self.num_generations, self.max_new = policy, num_generations, max_new
        self.stop_ids, self.pad_id = tuple(int(i) for i in stop_ids), pad_id
        self.context = policy.input_shape[1]
        # The sampler runs until every row has stopped or the buffer is full: a buffer of the
        # longest prompt and one completion, not of the whole context, bounds its steps.
        self.length = min(self.context, longest_prompt + max_new)
        self.sampler = make_sampler(temperature, top_p)
        self.task = export.find_task(policy)
        if self.task is not None:
            self.task.sampler = self.sampler  # what its generate_step samples with
        self.variables = list(policy.trainable_variables) + list(policy.non_trainable_variables)
        self.compiled = jax.jit(self._sample)

    def __call__(self, prompts: list, seed: int, index: int) -> Samples:
        """Samples `num_generations` completions of each of `prompts` (token id lists), with
        the random stream of batch `index` of the run of `seed`."""
        rows = [ids for ids in prompts for _ in range(self.num_generations)]
        tokens = np.full((len(rows), self.length), self.pad_id, "int32")
        given = np.zeros(tokens.shape, bool)
        for row, ids in enumerate(rows):
            tokens[row, :len(ids)], given[row, :len(ids)] = ids, True
        state = self.sampler.variables[0]
        seed_state = np.array([seed, index], dtype=keras.backend.standardize_dtype(state.dtype))
        out = self.compiled([v.value for v in self.variables], seed_state,
                             on_the_mesh(tokens), on_the_mesh(given))
        return self._cut(local_rows(out), np.array([len(ids) for ids in rows]))

    def _sample(self, values, seed_state, tokens, given):
        mapping = list(zip(self.variables, values)) + [(self.sampler.variables[0], seed_state)]
        with keras.StatelessScope(state_mapping=mapping):
            if self.task is not None:
                return self.task.generate_step({"token_ids": tokens, "padding_mask": given},
                                               stop_token_ids=self.stop_ids)["token_ids"]

            def next_logits(tokens, cache, index):  # the model reads its whole context
                padded = keras.ops.pad(tokens, [[0, 0], [0, self.context - self.length]],
                                       constant_values=self.pad_id)
                logits = self.policy(padded, training=False)
                return keras.ops.take(logits, index - 1, axis=1), None, cache
            start = keras.ops.min(keras.ops.sum(keras.ops.cast(given, "int32"), axis=1))
            return self.sampler(next_logits, tokens, index=start, mask=given,
                                stop_token_ids=self.stop_ids, model=self.policy)

    def _cut(self, tokens: np.ndarray, prompt_lengths: np.ndarray) -> Samples:
        """Each completion cut after its first stop token or `max_new` tokens, padding after it,
        and to the context's length and one more token, so that every target has a token."""
        lengths, stopped = np.zeros(len(tokens), "int32"), np.zeros(len(tokens), bool)
        for row, start in enumerate(prompt_lengths):
            new = tokens[row, start:start + self.max_new]
            ends = np.flatnonzero(np.isin(new, self.stop_ids))
            lengths[row] = ends[0] + 1 if len(ends) else len(new)
            stopped[row] = bool(len(ends))
            tokens[row, start + lengths[row]:] = self.pad_id
        padding = np.full((len(tokens), self.context + 1 - self.length), self.pad_id, "int32")
        tokens = np.concatenate([tokens, padding], axis=1)
        return Samples(tokens, prompt_lengths, lengths, stopped)


def on_the_mesh(array: np.ndarray):
    """This host's rows as one global array, split over the batch axes as a training batch is
    (`keras.distribution`'s data layout), or as it is without a distribution."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return array
    layout = distribution.get_data_layout(array.shape)
    return jax.make_array_from_process_local_data(layout.backend_layout, array)


def local_rows(array) -> np.ndarray:
    """This host's rows of a global array split by rows (every row once, in order)."""
    if jax.process_count() == 1:
        return np.array(array)
    pieces = {}
    for shard in array.addressable_shards:
        pieces.setdefault(shard.index[0].start or 0, np.asarray(shard.data))
    return np.concatenate([pieces[start] for start in sorted(pieces)])
