"""GRPO's step source: sample, score, update, repeat (`SampleThenUpdate`), inside the run's
outer loop (`training.controller`: checkpoints, preemption, the non-finite guard, lost
hosts, profiles and the ending are its).

Each batch of samples is `train.batch_size / grpo.num_generations` prompts
(`data.prompts`), each completed `num_generations` times by the policy
(`models.grpo_sampling`). The reward functions (`models.rewards`) score the
completions on the host; each completion's advantage is its reward against
its group's (`models.grpo.advantages`); then `grpo.num_iterations` updates
train on the batch, each one step of the toolkit's (`model.train_on_batch`,
so the non-finite guard, gradient accumulation and the token mean apply as
in every run), with the controller's callbacks called around it as `fit`
calls them, one "epoch" per log interval. With more than one, the sampling policy's log-probabilities
are computed once before the first, for the ratio.

A step is one update, as everywhere else: `train.steps`, the schedule, the
log, evaluations and checkpoints count steps, and each of their intervals
is a whole number of batches of samples (`objectives.grpo`'s check), so a
checkpoint falls between two batches (a preemption's too). Which prompts a
batch holds and its random
stream are functions of the batch's index (`data.prompts`,
`models.grpo_sampling`), so a run resumed from a checkpoint samples the same
completions and computes the same losses as the run that went through.

Rewards of a batch cannot overlap the next batch's sampling: that needs the
update the rewards make. They run on each host for its own rows (a group
never spans hosts).

The log line gives what TRL's gives: the reward's mean and its std within
groups, each function's mean, KL to the reference (beta > 0), the clip
fraction, the completions' mean length and the share cut at
`max_completion_length`, and the sampler's throughput in completion tokens
per second. Evaluation samples the same way from `data.prompts.eval_files`,
every prompt once, with one fixed random stream, so two evaluations differ
by the policy alone. The time line gains `sampling` and `rewards`.
"""

# Imported inside functions: TensorFlow (start-up time: the completions' writer alone needs it).
import collections
import contextlib
import json
import os
import time

import keras
import numpy as np

from tpu_keras import workdir as workdir_lib
from tpu_keras.data import prompts as prompts_lib, text as text_lib, tokenizers
from tpu_keras.errors import UserError
from tpu_keras.models import grpo as grpo_lib, grpo_sampling, rewards as rewards_lib

EVAL_STREAM = 2 ** 31  # the index of evaluation's random stream, past any training batch's


class SampleThenUpdate:
    """The step source of a GRPO run: batches of samples, each trained on
    `grpo.num_iterations` times."""

    def __init__(self, run, workdir: str):
        self.run_setup, self.workdir = run, workdir
        self.policy = run.model.policy  # what the run exports
        self.batches = Batches(run.config, run.cluster, self.policy)

    def run(self, controller, step: int, skipped: list):
        """Trains from `step` to `train.steps`; returns (the last evaluation's figures,
        the same), {} without eval_files."""
        del skipped  # GRPO's batches are sampled, never left out (train.on_nonfinite='stop')
        config, model, checkpointer = self.run_setup.config, self.run_setup.model, self.run_setup.checkpointer
        grpo, train_cfg, every = config.grpo, config.train, config.log.every_steps
        batches, run_timings = self.batches, controller.timings
        run_timings.always_shown |= {"sampling", "rewards"}
        hooks = keras.callbacks.CallbackList(
            controller.callbacks(steps_per_boundary=grpo.num_iterations), model=model)
        evaluated = {}
        if step == 0 and batches.evaluating:
            evaluated = self._evaluation(controller, 0)
        interval = collections.defaultdict(list)
        hooks.on_train_begin()
        epoch_start = step
        hooks.on_epoch_begin(step // every)
        while step < train_cfg.steps:
            index = step // grpo.num_iterations
            samples, stats = batches.sample(index, run_timings)
            if grpo.log_completions:
                batches.write_completions(os.path.join(self.workdir, "completions"), index,
                                          samples, stats["advantage"])
            inputs = batches.training_inputs(samples, stats.pop("advantage"), model)
            for _ in range(grpo.num_iterations):
                hooks.on_train_batch_begin(step - epoch_start)
                logs = model.train_on_batch(*inputs, return_dict=True)
                for key, value in logs.items():
                    interval[key].append(float(value))
                hooks.on_train_batch_end(step - epoch_start, logs)  # the guard; SIGTERM: save, exit 42
                step = checkpointer.step
            for key, value in stats.items():  # the log line: the update's figures, then the samples'
                interval[key].append(value)
            if step % every == 0:
                scalars = {key: float(np.mean(values)) for key, values in interval.items()}
                scalars["learning_rate"] = float(keras.ops.convert_to_numpy(
                    model.optimizer.learning_rate))
                controller.log(step, scalars)
                interval = collections.defaultdict(list)
                if batches.evaluating and step % train_cfg.eval_every == 0:
                    evaluated = self._evaluation(controller, step)
                hooks.on_epoch_end(step // every - 1)  # the interval's save
                if step < train_cfg.steps:
                    epoch_start = step
                    hooks.on_epoch_begin(step // every)
        hooks.on_train_end()
        controller.fit_timer.fit_returned()
        return evaluated, evaluated

    def _evaluation(self, controller, step: int) -> dict:
        figures = self.batches.evaluate(controller.timings)
        controller.log(step, figures)
        return figures


class Batches:
    """The run's batches of samples: prompts, their completions, rewards and the inputs of
    an update."""

    def __init__(self, config, cluster, policy):
        grpo = config.grpo
        self.config, self.grpo = config, grpo
        self.host, self.hosts = cluster.host_index, cluster.num_processes
        self.per_batch = config.train.batch_size // grpo.num_generations  # prompts, all hosts
        self.tokenizer = tokenizers.make(text_lib.prepared(config.data).tokens)
        context = policy.input_shape[1]
        room = context - grpo.max_completion_length
        self.prompts = prompts_lib.read(config.data, training=True)
        prompts_lib.check_lengths(self.prompts, room, grpo.max_completion_length)
        prompts_lib.check_batch(self.prompts, self.per_batch, self.hosts, "files")
        self.eval_prompts = None
        if config.data.prompts.eval_files:
            self.eval_prompts = prompts_lib.read(config.data, training=False)
            prompts_lib.check_lengths(self.eval_prompts, room, grpo.max_completion_length)
        self.rewards = rewards_lib.load(grpo.rewards, grpo.reward_weights, key="grpo.rewards")
        stop_ids = [self.tokenizer.eos_id] + _stop_id(self.tokenizer, grpo.stop)
        self.sampler = grpo_sampling.GroupSampler(
            policy, num_generations=grpo.num_generations, max_new=grpo.max_completion_length,
            stop_ids=stop_ids, pad_id=next(i for i in range(3) if i not in stop_ids),
            temperature=grpo.temperature, top_p=grpo.top_p,
            longest_prompt=max(len(t) for t in self.prompts.tokens + (
                self.eval_prompts.tokens if self.eval_prompts else [])))
        self._sampled_before = False  # the first sampling compiles: kept out of the throughput
        self._log_probs = None  # grpo_sampling.LogProbs, made where num_iterations > 1

    @property
    def evaluating(self) -> bool:
        return self.eval_prompts is not None

    def sample(self, index: int, run_timings):
        """(Samples, figures) of batch `index`: this host's prompts, completed and scored."""
        positions = self.prompts.batch(index, self.per_batch, self.config.seed, self.host, self.hosts)
        samples, seconds = self._complete(self.prompts, positions, index, run_timings)
        with run_timings.phase("rewards"):
            total, each = self._score(self.prompts, positions, samples)
        advantage = keras.ops.convert_to_numpy(grpo_lib.advantages(
            total, self.grpo.num_generations, self.grpo.scale_rewards))
        grouped = total.reshape(-1, self.grpo.num_generations)
        stats = {"reward": float(total.mean()),
                 "reward_std": float(grouped.std(axis=1, ddof=1).mean()),  # TRL's: within groups
                 **{f"reward_{_short(name)}": float(v.mean()) for name, v in each.items()},
                 "completion_length": float(samples.completion_lengths.mean()),
                 "completion_clipped": float(1 - samples.stopped.mean()),
                 "advantage": advantage}
        if seconds:
            stats["sampling_tokens_per_second"] = samples.completion_lengths.sum() / seconds
        self._last = (positions, samples, total)
        return samples, _global_means(stats, self.hosts)

    def write_completions(self, folder: str, index: int, samples, advantage) -> None:
        """DIR/completions/INDEX-hostH.jsonl: each row of batch `index` on this host, as one
        JSON line (the prompt, the completion, its reward and advantage), written whole."""
        positions, _, total = self._last
        generations = self.grpo.num_generations
        lines = [json.dumps({"batch": index, "prompt": self.prompts.records[positions[row // generations]][
                             self.prompts.field], "completion": text, "reward": float(total[row]),
                             "advantage": float(advantage[row])})
                 for row, text in enumerate(self._texts(samples))]
        import tensorflow as tf  # gfile: the workdir may be on gs://
        tf.io.gfile.makedirs(folder)
        workdir_lib.write_whole(os.path.join(folder, f"{index:06d}-host{self.host}.jsonl"),
                                "".join(line + "\n" for line in lines))

    def training_inputs(self, samples, advantage, model):
        """(tokens, y_true, sample weights) of an update: y_true holds on every token the
        sampling policy's log-probability, the advantage and the completion mask."""
        mask = samples.mask()
        old = np.zeros_like(mask)
        if self.grpo.num_iterations > 1:  # the ratio's denominator, before the first update
            if self._log_probs is None:
                self._log_probs = grpo_sampling.LogProbs(model)
            old = self._log_probs(samples.tokens)
        y_true = np.stack([old, np.broadcast_to(advantage[:, None], mask.shape), mask], axis=-1)
        return samples.tokens, y_true.astype("float32"), grpo_lib.sample_weights(
            mask, self.grpo.loss_type)

    def evaluate(self, run_timings=None) -> dict:
        """The mean reward (and each function's) of every evaluation prompt's completions,
        with evaluation's one random stream (`run_timings`: where the sampling's time goes)."""
        sums, count = collections.defaultdict(float), 0
        share = self.per_batch // self.hosts
        for start in range(0, len(self.eval_prompts), self.per_batch):
            chosen = list(range(start, min(start + self.per_batch, len(self.eval_prompts))))
            real = len(chosen)
            chosen += [chosen[0]] * (self.per_batch - real)  # the last batch filled up, not counted
            mine = chosen[self.host * share:(self.host + 1) * share]
            counted = max(0, min(share, real - self.host * share)) * self.grpo.num_generations
            samples, _ = self._complete(self.eval_prompts, mine, EVAL_STREAM + start, run_timings)
            total, each = self._score(self.eval_prompts, mine, samples)
            for name, values in {"val_reward": total, **{f"val_reward_{_short(n)}": v
                                                         for n, v in each.items()}}.items():
                sums[name] += float(values[:counted].sum())
            sums["val_completion_length"] += float(samples.completion_lengths[:counted].sum())
            count += counted
        totals = _global_sums({**sums, "count": count}, self.hosts)
        return {name: value / totals["count"] for name, value in totals.items() if name != "count"}

    def _complete(self, prompts, positions, index, run_timings):
        """(Samples, seconds to count in the throughput: 0 for the compiling first call)."""
        started = time.perf_counter()
        with run_timings.phase("sampling") if run_timings else contextlib.nullcontext():
            samples = self.sampler([prompts.tokens[i] for i in positions], self.config.seed, index)
        seconds = time.perf_counter() - started if self._sampled_before else 0.0
        self._sampled_before = True
        return samples, seconds

    def _score(self, prompts, positions, samples):
        generations = self.grpo.num_generations
        rows = [i for i in positions for _ in range(generations)]
        texts = self._texts(samples)
        fields = {name: [values[i // generations] for i in range(len(rows))]
                  for name, values in prompts.fields(positions).items()}
        return rewards_lib.score(self.rewards, [prompts.records[i][prompts.field] for i in rows],
                                 texts, fields)

    def _texts(self, samples) -> list:
        return [tokenizers.decode(self.tokenizer, ids) for ids in samples.completions()]


def _stop_id(tokenizer, text: str) -> list:
    """[the id of `grpo.stop`'s one token], or [] when it is empty."""
    if not text:
        return []
    import tensorflow as tf
    ids = [int(i) for i in tokenizer.tokenize(tf.constant([text])).to_list()[0]]
    if len(ids) != 1:
        raise UserError(f"grpo.stop={text!r} is {len(ids)} tokens of {tokenizer.name}; give the "
                        "text of one token, such as '\\n', or '' for the end token alone")
    return ids


def _short(name: str) -> str:
    """A reward function's log name: 'my_rewards:is_correct' -> 'is_correct'."""
    return name.rsplit(":", 1)[-1]


def _global_means(stats: dict, hosts: int) -> dict:
    """The figures of this host's rows averaged over every host's (equal shares); the
    advantages stay this host's."""
    if hosts == 1:
        return stats
    from jax.experimental import multihost_utils
    names = [k for k in stats if k != "advantage"]  # in the same order on every host
    means = multihost_utils.process_allgather(np.array([stats[k] for k in names])).mean(axis=0)
    return {**dict(zip(names, means.tolist())), "advantage": stats["advantage"]}


def _global_sums(sums: dict, hosts: int) -> dict:
    if hosts == 1:
        return sums
    from jax.experimental import multihost_utils
    names = list(sums)
    totals = multihost_utils.process_allgather(np.array([sums[k] for k in names])).sum(axis=0)
    return dict(zip(names, totals.tolist()))
