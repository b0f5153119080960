"""A model family of the tests' own, in one file: Otter, keras-hub's Llama 3 under another name.

What adding a family takes (docs/models.md, "Model families"): a backbone
and a task keras-hub does not ship (here two subclasses, registered with
Keras so that a preset of them loads), and one `families.register` call
that says what the toolkit must know of them. Otter borrows Llama's layout
rules, ties and LoRA targets and keras-hub's Llama 3 transformers exporter,
and differs in one thing the tests can see: LoRA's default targets are the
four attention projections, not PEFT's q_proj and v_proj. A config names it
with `model.name='keras_hub:OtterCausalLM'` and
`model.imports=('tests/helpers/otter_family.py',)`.
"""

import keras
import keras_hub

from tpu_keras.models import families
from tpu_keras.models.families import llama


@keras.saving.register_keras_serializable(package="otter")
class OtterBackbone(keras_hub.models.Llama3Backbone):
    pass


@keras.saving.register_keras_serializable(package="otter")
class OtterCausalLM(keras_hub.models.Llama3CausalLM):
    backbone_cls = OtterBackbone


DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

FAMILY = families.register(families.Family(
    name="otter",
    backbones=("OtterBackbone",),
    layout=llama.layout,
    ties=llama.TIES,
    lora_targets=llama.LORA_TARGETS,
    lora_default=DEFAULT_TARGETS,
    exporter="Llama3Backbone",
    tasks=(OtterCausalLM,),
))
