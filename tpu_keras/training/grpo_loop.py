"""GRPO's run: sample, score, update, repeat. `train_with_grpo(run, workdir, timings)`; `training.loop`
hands a run of `data.prompts` here once it is set up.

Each batch of samples is `train.batch_size / grpo.num_generations` prompts
(`data.prompts`), each completed `num_generations` times by the policy
(`models.grpo_sampling`). The reward functions (`models.rewards`) score the
completions on the host; each completion's advantage is its reward against
its group's (`models.grpo.advantages`); then `grpo.num_iterations` updates
train on the batch, each one step of the toolkit's (`model.train_on_batch`,
so the non-finite guard, gradient accumulation and the token mean apply as
in every run). With more than one, the sampling policy's log-probabilities
are computed once before the first, for the ratio.

A step is one update, as everywhere else: `train.steps`, the schedule, the
log, evaluations and checkpoints count steps, and each of their intervals
is a whole number of batches of samples (`config.check`), so a checkpoint
falls between two batches. Which prompts a batch holds and its random
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

# Imported inside functions: TensorFlow (start-up time: the summary writer alone needs it).
import collections
import json
import os
import time

from absl import logging
import keras
import numpy as np

from tpu_keras import workdir as workdir_lib
from tpu_keras.data import prompts as prompts_lib, text as text_lib, tokenizers
from tpu_keras.errors import UserError
from tpu_keras.models import grpo as grpo_lib, grpo_sampling, rewards as rewards_lib
from tpu_keras.training import callbacks, finish, preemption

EVAL_STREAM = 2 ** 31  # the index of evaluation's random stream, past any training batch's


def train_with_grpo(run, workdir: str, run_timings) -> dict:
    """Trains `run` (a `training.setup.RunSetup` of data.prompts) to `train.steps`; returns
    the last evaluation's figures ({} without eval_files)."""
    cluster, config, model, checkpointer = run.cluster, run.config, run.model, run.checkpointer
    grpo, train_cfg = config.grpo, config.train
    batch = Batches(config, cluster, model.policy)
    logger = _Logger(train_cfg.steps, os.path.join(workdir, "tensorboard") if cluster.is_chief else None)
    guard = preemption.SaveOnPreemption(checkpointer, cluster)
    guard.set_model(model)
    run_timings.always_shown |= {"sampling", "rewards"}
    checkpointer.save = run_timings.timed("checkpoints", checkpointer.save)
    step = run_timings.timed("restore", checkpointer.restore_latest)()
    evaluated = {}
    if step == 0 and batch.evaluating:
        evaluated = logger.evaluation(0, batch.evaluate(run_timings))
    interval, first_call = collections.defaultdict(list), True
    try:
        while step < train_cfg.steps:
            index = step // grpo.num_iterations
            samples, stats = batch.sample(index, run_timings)
            if grpo.log_completions:
                batch.write_completions(os.path.join(workdir, "completions"), index, samples,
                                        stats["advantage"])
            inputs = batch.training_inputs(samples, stats.pop("advantage"), model)
            for _ in range(grpo.num_iterations):
                started = time.perf_counter()
                if first_call and run.compile_counter:
                    run.compile_counter.begin()
                logs = model.train_on_batch(*inputs, return_dict=True)
                calls = run_timings.first_host_calls if first_call else run_timings.host_calls
                calls.append(time.perf_counter() - started)
                if first_call and run.compile_counter:
                    run.compile_counter.end()
                first_call = False
                if checkpointer.step == step:
                    _stop_on_nonfinite(step + 1, checkpointer)
                step = checkpointer.step
                for key, value in logs.items():
                    interval[key].append(float(value))
            for key, value in stats.items():
                interval[key].append(value)
            guard.on_train_batch_end(0)  # SIGTERM: save this step, exit 42
            if step % config.log.every_steps == 0:
                logger.training(step, interval, model)
                interval = collections.defaultdict(list)
            if batch.evaluating and step % train_cfg.eval_every == 0:
                evaluated = logger.evaluation(step, batch.evaluate(run_timings))
            if step % config.checkpoint.every_steps == 0 or step >= train_cfg.steps:
                checkpointer.save()
    except BaseException:
        finish.wait_for_the_last_save(checkpointer, run_timings, failing=True)
        raise
    finish.wait_for_the_last_save(checkpointer, run_timings)
    if evaluated:
        logging.info("done at step %d: val_reward %.4g", step, evaluated["val_reward"])
    logging.info("weights fingerprint: %.12e", finish.fingerprint(model))
    with run_timings.phase("export"):
        finish.export(model.policy, config, workdir, cluster)
    logger.close()
    return evaluated


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

    def evaluate(self, run_timings) -> dict:
        """The mean reward (and each function's) of every evaluation prompt's completions,
        with evaluation's one random stream."""
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
        with run_timings.phase("sampling"):
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


class _Logger:
    """GRPO's log lines and TensorBoard scalars, training's (per interval) and evaluation's."""

    def __init__(self, total_steps: int, summary_dir):
        self._total = total_steps
        self._writer = None
        if summary_dir:
            import tensorflow as tf
            self._writer = tf.summary.create_file_writer(summary_dir)

    def training(self, step: int, interval: dict, model) -> None:
        scalars = {key: float(np.mean(values)) for key, values in interval.items()}
        scalars["learning_rate"] = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
        self._write(step, scalars)

    def evaluation(self, step: int, figures: dict) -> dict:
        self._write(step, figures)
        return figures

    def _write(self, step: int, scalars: dict) -> None:
        callbacks.log_scalars(step, self._total, scalars, self._writer)

    def close(self) -> None:
        if self._writer:
            self._writer.close()


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


def _stop_on_nonfinite(step: int, checkpointer) -> None:
    last = checkpointer.latest_saved_step()
    kept = (f"the last good checkpoint (step {last}) is kept in {checkpointer.shared_dir}"
            if last is not None else "nothing was saved")
    raise UserError(f"the loss or the gradient norm is not finite at step {step}; {kept}; lower "
                    "train.learning_rate, or check what the reward functions return")
