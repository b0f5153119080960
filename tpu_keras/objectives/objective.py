"""What an objective is: the one place that knows how a kind of data trains a model.

An objective names the kind of data it reads (`data_kinds`), the config
section of its own settings (`section`), and answers every question the run,
the evaluation job and the planner would otherwise answer by looking at the
data: the loss and metrics, the model that wraps the trained one (and whether
it holds a reference), the step source (Keras `fit`, or one of its own), the
evaluation, the planner's terms and the lines of its report. `Objective`
itself is supervised fine-tuning's answer to each, so an objective says only
where it differs.

A module of the user's (`model.imports`) registers its own with
`tpu_keras.objectives.register`, and a config chooses it with `train.objective`.
"""

# Imported inside functions: Keras and the models (the engine must be selected first:
# engine.select); the checks run before it is.


class Objective:
    """Supervised fine-tuning's answers; a subclass overrides where its objective differs."""

    name = ""
    # The kinds of data it reads (`data_section.KINDS`; '' for a config that names no data yet).
    data_kinds: tuple = ()
    # The kind of data for which `train.objective='auto'` chooses it.
    chosen_for: tuple = ()
    # Its own config section ('' for none): set while another objective trains, it is refused.
    section = ""
    # The log name of a sequence in an example: a DPO example is two.
    sequences_per_example = 1
    # Whether the planner compiles the wrapped model's step (GRPO's clipped loss) rather than
    # the language model's own over `sequences_per_example` times the rows (DPO's pairs).
    plans_its_wrapper = False
    # Whether its batches are sequences `mesh.context` may split (DPO's pairs and GRPO's
    # sampled rows are one token longer than the model's and cut inside its model).
    splits_sequences = True
    # What a non-finite step's error suggests besides lowering the learning rate.
    nonfinite_hint = ("check the data, or set train.on_nonfinite='restore_and_skip' to leave such "
                      "batches out")

    def check(self, config) -> None:
        """One-line `UserError`s for its section, checked before Keras loads."""

    def builder(self, builder, config):
        """The model's registry `Builder` with this objective's loss and metrics."""
        return builder

    def holds_reference(self, config) -> bool:
        """Whether the wrapped model holds a reference policy (a frozen copy for a full
        fine-tune; the base with its adapters off under LoRA)."""
        return False

    def wrap(self, model, reference, config):
        """The model a step trains: `model` itself, or a wrapper around it and `reference`
        (None where no frozen copy is held)."""
        return model

    def steps_per_execution(self, chosen: int) -> int:
        """Steps per execution, given the platform's choice."""
        return chosen

    def check_model(self, config, model) -> None:
        """Checks of the built model against the data (a vocabulary that fits)."""

    def flops_per_example(self, model) -> float:
        """Model FLOPs of one training example, for MFU."""
        from tpu_keras.measurement import flops
        return flops.training_flops_per_example(model)

    def steps(self, run, workdir: str):
        """The step source of the run's outer loop (`training.controller`): None for Keras
        `fit` (`training.fit_steps`), or an object with `policy` (what the run exports) and
        `run(controller, start_step, skipped)`, which trains to `train.steps` and returns
        (the run's result, its last validation's {val_metric: value})."""
        return None

    def evaluation(self, run, workdir: str):
        """A function of no arguments that evaluates the restored model and returns
        {val_metric: value}; None for Keras `evaluate` on the data's eval split."""
        return None

    def plan_terms(self, config) -> dict:
        """What the planner adds for this objective: {'reference': bool (a frozen copy of
        the weights), 'sampling': bool (a sampler's cache beside the step)}."""
        return {"reference": self.holds_reference(config) and not config.model.get("lora_rank"),
                "sampling": False}

    def plan_lines(self, plan: dict) -> list:
        """The lines the planner's report gives about this objective."""
        return []
