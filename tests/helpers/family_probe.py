"""A family registered from one file of the tests' own (otter_family.py), trained with LoRA and
exported, as a run of it does.

    python tests/helpers/family_probe.py OUT_DIR DATA_DIR

`configs/llama_stdlib.py:lora` (a freshly initialised preset fine-tuned with
LoRA rank 4) with `model.name='keras_hub:OtterCausalLM'` and
`model.imports` naming otter_family.py, trained on the tf engine through
`tpu_keras.training.loop.train`. Its exports are read by their own clients:
transformers (DIR/export/transformers) and PEFT (DIR/export/peft on the base
the export writes beside it). Prints one line, `FAMILY {json}`: the largest
logit differences, the adapter's config and the trainable count.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from tpu_keras.cluster import engine  # noqa: E402

engine.select("tf")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tpu_keras.training import loop  # noqa: E402

import hf_checkpoints  # noqa: E402  (beside this script: its folder is sys.path[0])

out, data_dir = sys.argv[1:3]
FAMILY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "otter_family.py")
spec = importlib.util.spec_from_file_location("llama_stdlib", "configs/llama_stdlib.py")
configs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(configs)
config = configs.get_config("lora")
config.data.data_dir = data_dir
config.model.update(name="keras_hub:OtterCausalLM", imports=(FAMILY_FILE,))
config.train.update(steps=10, eval_every=10)
workdir = os.path.join(out, "otter")
model = loop.train(config, workdir).model

tokens = np.random.default_rng(0).integers(0, 256, (2, 64)).astype("int32")
expected = keras.ops.convert_to_numpy(model(tokens))


def torch_logits(folder, adapter=None):
    return hf_checkpoints.transformers_logits(folder, tokens, adapter)


export = os.path.join(workdir, "export")
with open(os.path.join(export, "peft", "adapter_config.json")) as file:
    adapter = json.load(file)
with open(os.path.join(workdir, "config.json")) as file:
    kept = json.load(file)["model"]
result = {
    "backbone": type(next(l for l in model.layers if hasattr(l, "backbone")).backbone).__name__,
    "trainable": int(sum(np.prod(w.shape) for w in model.trainable_weights)),
    "formats": sorted(os.listdir(export)),
    "transformers": float(np.max(np.abs(torch_logits(os.path.join(export, "transformers")) - expected))),
    "peft": float(np.max(np.abs(torch_logits(adapter["base_model_name_or_path"],
                                             os.path.join(export, "peft")) - expected))),
    "adapter": {key: adapter[key] for key in ("r", "lora_alpha", "target_modules")},
    "imports_kept": kept["imports"],
}
print("FAMILY " + json.dumps(result), flush=True)
