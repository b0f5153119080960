"""A LoRA run over a preset checkpoints what trains alone (tpu_keras/models/frozen_base.py): a kill -9
resumed over the same base ends with the run's exact weights, on both engines; a checkpoint
weighs the adapters and their optimizer state, not the base; a base changed since is one
`error:` line, and nothing in the workdir changes. What the checkpointers hold and restore,
older checkpoints holding the base included: tests/test_reliability.py (checkpoint_probe)."""

import hashlib
import json
import re
import shutil
import sys

import pytest

from conftest import assert_one_line_error, run_command, train
from resume import assert_same_weights, killed_after_checkpoint_then_resumed, resumed_step, weights

LORA = "configs/llama_stdlib.py:lora"
# A base of 1.2M parameters (4.7 MB in float32), to tell it from the adapters' 4,096 in a
# checkpoint's bytes (SAVE_BASE writes it); export: the cheapest format.
WIDER = ("--config.model.hidden_dim=256", "--config.model.intermediate_dim=1024",
         "--config.export.formats=('lora',)", "--config.deterministic=True")


# The base: the config's Llama, wider, freshly initialised and saved as a keras-hub preset.
SAVE_BASE = """
import sys
sys.path.insert(0, "configs")
import keras, keras_hub, llama_stdlib
arguments = {k: v for k, v in llama_stdlib.get_config("lora").model.items()
             if k not in ("name", "context_length", "layout_map", "preset", "lora_rank")}
keras.utils.set_random_seed(0)
arguments.update(hidden_dim=256, intermediate_dim=1024)
keras_hub.models.LlamaBackbone(**arguments).save_to_preset(sys.argv[1])
"""


def number(pattern, text):
    return int(re.search(pattern, text).group(1).replace(",", ""))


def checkpoint_bytes(workdir, step):
    """The bytes of the files of one checkpoint: Orbax's folder, or TensorFlow's ckpt-N.*."""
    folder = workdir / "checkpoints"
    files = [p for p in (folder / str(step)).rglob("*") if p.is_file()] or list(folder.glob(f"ckpt-{step}.*"))
    return sum(p.stat().st_size for p in files)


def files(folder):
    """{path: (mtime, sha256)} of every file under `folder`."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def changed_weights(preset):
    """Rewrites every float weight of a keras-hub preset in place (another base, same names)."""
    import h5py
    with h5py.File(preset / "model.weights.h5", "r+") as weights_file:
        weights_file.visititems(lambda name, item: item.__setitem__(Ellipsis, item[...] + 1.0)
                                if isinstance(item, h5py.Dataset) and item.dtype.kind == "f" else None)


@pytest.fixture(scope="module")
def saved_base(tmp_path_factory):
    """SAVE_BASE's preset, written once for both engines (each test changes a copy of its own)."""
    folder = tmp_path_factory.mktemp("lora_base") / "base"
    run_command([sys.executable, "-c", SAVE_BASE, str(folder)])
    return folder


@pytest.mark.slow  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
@pytest.mark.parametrize("engine", ["tf", "jax"])
def test_a_lora_checkpoint_holds_the_adapters_resumes_exactly_and_refuses_a_changed_base(
        engine, saved_base, data_dir, tmp_path):
    base, killed = tmp_path / "base", tmp_path / "killed"
    shutil.copytree(saved_base, base)
    args = (f"--config.data.data_dir={data_dir}", f"--config.engine={engine}", *WIDER,
            f"--config.model.preset={base}")
    reference = train(LORA, tmp_path / "reference", *args).stdout
    command = [sys.executable, "-m", "tpu_keras.train", f"--config={LORA}", f"--workdir={killed}", *args]
    resumed = killed_after_checkpoint_then_resumed(command, step=20)
    assert resumed_step(resumed) == 20, resumed[-2000:]
    assert_same_weights(killed, tmp_path / "reference")

    # The checkpoint: the factors, the random state and the optimizer's variables, no base.
    held = weights(killed)
    assert not [k for k in held if k.startswith("model_by_path/") and "lora_" not in k
                and "random_state" not in k], sorted(held)
    parameters = number(r"with ([\d,]+) parameters", reference)
    trainable = number(r"([\d,]+) of them trainable", reference)
    adapters_and_optimizer = 3 * 4 * trainable  # float32 factors, Adam's two moments
    bound = 2 * adapters_and_optimizer + 2 ** 20
    assert 4 * parameters > bound  # the base alone would not fit
    assert checkpoint_bytes(killed, 40) <= bound, (checkpoint_bytes(killed, 40), bound)
    recorded = json.loads((killed / "base.json").read_text())
    assert recorded["preset"] == str(base) and recorded["files"] == ["model.weights.h5"], recorded
    assert json.loads((killed / "model" / "kept.json").read_text()) == {"source": str(base)}

    # evaluate builds the base from model.preset again: the run's own figure.
    logged = re.search(r"step 40/40 \|.* val_bits_per_byte (\S+)", resumed).group(1)
    evaluated = run_command([sys.executable, "-m", "tpu_keras.evaluate", f"--workdir={killed}"]).stdout
    again = re.search(r"^step 40 \|.* val_bits_per_byte (\S+)", evaluated, re.M).group(1)
    assert float(again) == pytest.approx(float(logged), abs=5e-4), (again, logged)  # logged: 4 digits

    # Another base at model.preset: one line, exit 2, nothing in the workdir written or lost.
    changed_weights(base)
    before = files(killed)
    refused = train(LORA, killed, *args, "--config.train.steps=50", check=False)
    assert refused.returncode == 2, refused.stdout[-3000:]
    assert_one_line_error(refused, f"model.preset='{base}' is not the base this run's checkpoints were "
                                   "trained on (its weight files' contents differ",
                          "put the original base back at model.preset, or start the new base in "
                          "another --workdir")
    assert files(killed) == before
