"""Model families: what the toolkit knows of each keras-hub model family, one file a family.

keras-hub keeps one converter file per family behind a fixed interface; so do
we. A family file (`llama.py`, `mistral.py`, `qwen.py`, `gemma.py`) registers
one `Family`, and every path that reads, lays out, adapts or writes a model of
that family asks it, never a table of its own:

| field | what it holds | asked by |
| --- | --- | --- |
| `backbones`, `model_types` | the keras-hub backbones it covers; the transformers `model_type`s keras-hub converts to them | every lookup below |
| `converter_keys`, `read_config` | the config.json keys keras-hub's converter leaves out; what the backbone cannot express | `hub_presets` (every checkpoint read: training, `generate --preset`) |
| `convert_weights` | the family's own reading of the weights, where keras-hub's converter cannot read what transformers writes | `hub_presets` |
| `converter_model_types`, `converter_prefixes` | a model_type keras-hub's loader knows by another name, and its weights' names | `hub_presets` |
| `repair` | a fix of what keras-hub builds wrong (weight paths), once the backbone is built | `hub_presets`, `hub`, `export` (every backbone built) |
| `layout`, `ties` | layout rules (regex -> mesh axes) of the weights | `hub` (the run, `layout`, `plan`) |
| `lora_targets`, `lora_default` | the projections LoRA adapts, under PEFT's names, with their transformers modules | `hub` (LoRA), `peft_format` (the adapter) |
| `attention`, `delta_nets` | attention and linear-attention classes kept to one example of a packed row | `segments` |
| `fused_attention` | attention layer classes the TPU's fused kernel serves | `splash_attention` |
| `exporter`, `transformers_config`, `transformers_weights`, `transformers_tokenizer` | keras-hub's transformers exporter to write it with, and the family's own pieces where keras-hub has none or gets one wrong | `export` |
| `tasks` | task classes outside `keras_hub.models` (a family of your own) | `hub` (`model.name`) |

Adding a family is one file that calls `register`, and a test beside it. A
file of your own is imported through `model.imports`; a family registered
later takes over the backbones it names from an earlier one.
"""

from tpu_keras.models.families.family import (Family, Target, Unreadable, exporter, known,
                                              no_rope_scaling, of_backbone, of_model_type,
                                              refuse_first, register, repaired, rope_parameters, rope_type,
                                              tasks, transformers_exporter, unbuilt_llama_parts)
# The families the toolkit ships; each module registers itself.
from tpu_keras.models.families import (gemma, gemma3, gemma4, gpt_oss, llama, mistral, qwen,  # noqa: E402,F401
                                       mixtral, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, smollm3)

__all__ = ["Family", "Target", "Unreadable", "exporter", "known", "no_rope_scaling", "of_backbone",
           "of_model_type", "refuse_first", "register", "repaired", "rope_parameters", "rope_type", "tasks",
           "transformers_exporter", "unbuilt_llama_parts"]
