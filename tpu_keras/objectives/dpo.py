"""DPO (Rafailov et al. 2023) on preference pairs, as TRL's `DPOTrainer` computes it: each
example is a (chosen, rejected) pair through the policy and the reference, which is the
model as training started (`models.preference`). Its settings are the `dpo` section."""

# Imported inside functions: Keras and the models (the engine must be selected first:
# engine.select); the checks run before it is.
import math

from tpu_keras.errors import UserError
from tpu_keras.objectives.objective import Objective


class DirectPreferenceOptimization(Objective):
    name = "dpo"
    splits_sequences = False  # its rows are one token longer than the model's
    data_kinds = ("preferences",)
    chosen_for = ("preferences",)
    section = "dpo"
    sequences_per_example = 2

    def check(self, config) -> None:
        beta = config.dpo.beta
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0 \
                or not math.isfinite(beta):
            raise UserError(f"dpo.beta={beta!r} must be a number above 0; DPO's beta is how "
                            "strongly the policy is held to the reference, such as 0.1")

    def builder(self, builder, config):
        from tpu_keras.models import preference
        return preference.with_dpo_loss(builder, config.dpo.beta)

    def holds_reference(self, config) -> bool:
        return True

    def wrap(self, model, reference, config):
        from tpu_keras.models import preference
        return preference.PairsModel(model, reference)

    def check_model(self, config, model) -> None:
        from tpu_keras.data import preferences, text
        text.check_vocabulary(preferences.make_tokenizer(config.data),
                              model.policy.output_shape[-1], config.data)

    def flops_per_example(self, model) -> float:
        """Two sequences, each also through the reference's forward pass."""
        from tpu_keras.measurement import flops
        return 2 * (flops.training_flops_per_example(model.policy)
                    + flops.forward_flops_per_example(model.policy))

    def plan_lines(self, plan: dict) -> list:
        return ["DPO: each example is a pair, 2 sequences (chosen, rejected); the reference's "
                "forward pass keeps nothing for the backward, and " +
                ("it is a frozen copy of the weights" if "reference" in plan["per_device"] else
                 "it is the base with the adapters off, so it adds no weights")]


OBJECTIVE = DirectPreferenceOptimization()
