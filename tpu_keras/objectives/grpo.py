"""GRPO (Shao et al. 2024) on prompts, as TRL's `GRPOTrainer` computes it: the policy samples
a group of completions of each prompt inside the run, reward functions score them, and
each completion's advantage is its reward against its group's (`models.grpo`). Its
settings are the `grpo` section, TRL's names with TRL's meanings; its step source samples,
scores and updates (`objectives.grpo_steps`)."""

# Imported inside functions: Keras and the models (the engine must be selected first:
# engine.select); the checks run before it is.
from tpu_keras.config import GRPO_LOSS_TYPES as LOSS_TYPES
from tpu_keras.errors import UserError, closest
from tpu_keras.objectives.objective import Objective


class GroupRelativePolicyOptimization(Objective):
    name = "grpo"
    splits_sequences = False  # its rows are one token longer than the model's
    data_kinds = ("prompts",)
    chosen_for = ("prompts",)
    section = "grpo"
    plans_its_wrapper = True
    nonfinite_hint = "check what the reward functions return"

    def check(self, config) -> None:
        """On the jax engine, its batch in whole groups and its intervals in whole batches
        of samples."""
        grpo, train = config.grpo, config.train
        if config.engine != "jax":
            raise UserError("GRPO (data.prompts) samples inside the run on the jax engine; set "
                            "engine='jax'")
        for key in ("service_address", "log_example_ids"):
            if config.data[key]:
                raise UserError(f"data.{key} does not apply to data.prompts: GRPO's batches are "
                                "sampled inside the run; drop it (grpo.log_completions writes what "
                                "each batch held)")
        if not grpo.rewards:
            raise UserError("grpo.rewards is empty; name the reward functions, such as "
                            "('my_rewards:is_correct',) or ('rewards.py:is_correct',)")
        if grpo.reward_weights and len(grpo.reward_weights) != len(grpo.rewards):
            raise UserError(f"grpo.reward_weights has {len(grpo.reward_weights)} weights for "
                            f"{len(grpo.rewards)} reward functions; give one per function, or ()")
        if isinstance(grpo.num_generations, bool) or not isinstance(grpo.num_generations, int) \
                or grpo.num_generations < 2:
            raise UserError(f"grpo.num_generations={grpo.num_generations!r}: GRPO compares each "
                            "completion with the others of its prompt, so a group needs 2 or more; "
                            "set it to such as 8")
        context = config.model.get("context_length", 0)
        if isinstance(context, int) and 0 < context <= grpo.max_completion_length:
            raise UserError(f"grpo.max_completion_length={grpo.max_completion_length} leaves no room for "
                            f"a prompt in model.context_length={context} tokens (a prompt and its "
                            f"completion share the context); set it below {context}, or raise "
                            "model.context_length")
        if train.batch_size % grpo.num_generations:
            raise UserError(f"train.batch_size={train.batch_size} is not a multiple of "
                            f"grpo.num_generations={grpo.num_generations}: a batch holds whole groups "
                            "(train.batch_size counts completions, as TRL's does)")
        if grpo.loss_type not in LOSS_TYPES:
            raise UserError(f"grpo.loss_type={grpo.loss_type!r} is not one of {LOSS_TYPES}"
                            f"{closest(grpo.loss_type, LOSS_TYPES)}")
        if not 0 < grpo.top_p <= 1 or not grpo.temperature > 0:
            raise UserError(f"grpo.top_p={grpo.top_p!r} and grpo.temperature={grpo.temperature!r}: "
                            "set top_p above 0 and at most 1, and temperature above 0")
        for name in ("checkpoint.every_steps", "log.every_steps", "train.eval_every", "train.steps"):
            section, key = name.split(".")
            if config[section][key] % grpo.num_iterations:
                raise UserError(f"{name}={config[section][key]} must be a multiple of "
                                f"grpo.num_iterations={grpo.num_iterations}: a batch of samples is "
                                "trained on that many times before the next is sampled")
        if train.on_nonfinite != "stop":
            raise UserError("train.on_nonfinite='restore_and_skip' leaves out a batch of the data, and "
                            "GRPO's batches are sampled by the policy; set train.on_nonfinite='stop'")
        if train.steps_per_execution > 1:
            raise UserError(f"train.steps_per_execution={train.steps_per_execution}: GRPO samples "
                            "between updates, so each execution is one step; set it to 0 or 1")

    def builder(self, builder, config):
        from tpu_keras.models import grpo
        return grpo.with_grpo_loss(builder, config.grpo)

    def holds_reference(self, config) -> bool:
        return config.grpo.beta > 0  # 0: no KL term, so no reference

    def wrap(self, model, reference, config):
        from tpu_keras.models import grpo
        return grpo.GroupModel(model, reference, self.holds_reference(config),
                               config.grpo.temperature)

    def steps_per_execution(self, chosen: int) -> int:
        return 1  # the policy samples between any two updates

    def steps(self, run, workdir: str):
        from tpu_keras.objectives import grpo_steps
        return grpo_steps.SampleThenUpdate(run, workdir)

    def evaluation(self, run, workdir: str):
        """Every prompt of data.prompts.eval_files completed with evaluation's one random
        stream, as the run evaluates: the mean rewards."""
        from tpu_keras.objectives import grpo_steps
        batches = grpo_steps.Batches(run.config, run.cluster, run.model.policy)
        if not batches.evaluating:
            raise UserError(f"the GRPO run in {workdir} has no data.prompts.eval_files to evaluate "
                            "on; give them, as --config.data.prompts.eval_files=GLOB")
        return batches.evaluate

    def plan_terms(self, config) -> dict:
        return {**super().plan_terms(config), "sampling": True}

    def plan_lines(self, plan: dict) -> list:
        return [f"GRPO: each step trains on {plan['global_batch']:,} completions, "
                f"grpo.num_generations={plan['num_generations']} per prompt, sampled by the "
                "policy first; the reference " +
                ("is a frozen copy of the weights" if "reference" in plan["per_device"] else
                 "adds no weights (LoRA's base with the adapters off, or none with beta 0)")]


OBJECTIVE = GroupRelativePolicyOptimization()
