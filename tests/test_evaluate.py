"""Evaluation as its own job: `python -m tpu_keras.evaluate` gives the run's own validation
metrics, on another cluster too, survives checkpoints deleted under it, and refuses bad input.

(The jax engine on another mesh is in test_train.py, `--watch` over a 2-host run in
test_host_failure.py: both reuse runs those tests make anyway.)
"""

import glob
import os
import re
import shutil
import sys

import pytest

from conftest import assert_one_line_error, run_command, run_in_one_process


def evaluate(workdir, *flags, check=True):
    return run_command([sys.executable, "-m", "tpu_keras.evaluate", f"--workdir={workdir}", *flags],
                       check=check)


def scalars(folder):
    """{(step, tag): value} of the TensorBoard events in `folder` (not its subfolders)."""
    import tensorflow as tf
    found = {}
    for path in glob.glob(os.path.join(folder, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                found[event.step, value.tag] = float(tf.make_ndarray(value.tensor))
    return found


def assert_same_validation(workdir, steps):
    """The evaluation job wrote metrics at `steps`, and where the run validated too, the
    same ones within 1e-5."""
    ran, evaluated = scalars(workdir / "tensorboard"), scalars(workdir / "tensorboard" / "eval")
    assert sorted({step for step, _ in evaluated}) == sorted(steps), evaluated
    both = [key for key in evaluated if key in ran]
    assert both and all(tag.startswith("val_") for _, tag in evaluated), (evaluated, ran)
    for key in both:
        assert abs(evaluated[key] - ran[key]) <= 1e-5, (key, evaluated[key], ran[key])


def copy_run(source, target):
    """The parts of a finished run evaluate reads (the session's run stays as it is)."""
    target.mkdir()
    shutil.copy(source / "config.json", target)
    for folder in ("checkpoints", "tensorboard"):
        shutil.copytree(source / folder, target / folder, ignore=shutil.ignore_patterns("plugins"))
    return target


def test_evaluate_step_on_two_replicas_equals_the_runs_validation_on_one(tiny_run, tmp_path):
    workdir = copy_run(tiny_run[0], tmp_path / "run")
    out = evaluate(workdir, "--step=10", "--config.cluster.virtual_devices=2").stdout
    assert "mirrored strategy: 2 replica(s)" in out, out[-2000:]
    assert re.search(r"^step 10 \| val_bits_per_byte \d", out, re.M), out[-2000:]
    assert_same_validation(workdir, [10])


@pytest.mark.slow
def test_watch_skips_a_checkpoint_deleted_under_it_and_stops_at_the_last_step(tiny_run, tmp_path):
    workdir = copy_run(tiny_run[0], tmp_path / "run")
    for file in glob.glob(str(workdir / "checkpoints" / "ckpt-10.*")):
        os.remove(file)  # as checkpoint.keep deletes it, after the watcher listed it
    out = evaluate(workdir, "--watch", "--poll_seconds=0.1").stdout
    assert re.search(r"skipped step 10: .*ckpt-10 is unreadable", out), out[-2000:]
    assert re.findall(r"^step (\d+) \|", out, re.M) == ["20"], out[-2000:]
    assert_same_validation(workdir, [20])


def test_evaluate_refuses_a_folder_without_a_run_and_a_step_not_saved(tiny_run, tmp_path):
    assert_one_line_error(evaluate(tmp_path, check=False), "holds no training run")
    assert_one_line_error(evaluate(tiny_run[0], "--step=15", check=False),
                          "step 15 is not saved", "the saved steps are 10, 20")


@pytest.mark.slow
def test_a_run_keeps_its_model_when_its_preset_changes_or_goes_and_lora_needs_its_base(tmp_path):
    """A transformers checkpoint fine-tuned in full and with LoRA: each run copies it, all but
    its weights, into DIR/model. The full fine-tune's checkpoints hold every weight: `evaluate`
    gives its own figures after the checkpoint's config.json changed a value that no shape
    shows (rope_theta), and after the folder was deleted, `export` still writes the
    transformers folder with the source's config. The LoRA run's checkpoints hold its
    adapters alone (tpu_keras/models/frozen_base.py): the edit is one `error:` line, the
    original put back gives its own figures and a PEFT adapter that names the checkpoint,
    and the folder deleted is one `error:` line."""
    import json
    import hf_checkpoints
    checkpoint = tmp_path / "checkpoint"
    hf_checkpoints.write(checkpoint, "llama")
    (tmp_path / "text").mkdir()
    for i in range(4):
        (tmp_path / "text" / f"{i}.txt").write_text(hf_checkpoints.TEXT[i] * 20)

    def fine_tune(workdir, lora_rank):
        return run_command([sys.executable, "-m", "tpu_keras.train", "--config=configs/finetune.py",
             f"--workdir={workdir}", "--config.engine=tf", "--config.mesh.model=1",
             "--config.train.precision=float32", "--config.train.remat=none",
             f"--config.model.preset={checkpoint}", f"--config.model.lora_rank={lora_rank}",
             "--config.model.context_length=32", f"--config.data.text.files={tmp_path}/text/*.txt",
             f"--config.data.text.eval_files={tmp_path}/text/*.txt", "--config.train.batch_size=4",
             "--config.train.steps=4", "--config.train.warmup_steps=1", "--config.train.eval_every=4",
             "--config.log.every_steps=4", "--config.checkpoint.every_steps=4",
             "--config.train.compile_cache=off", "--config.export.formats=('transformers',)"]).stdout

    full, lora = tmp_path / "full", tmp_path / "lora"
    trained = fine_tune(full, 0)
    fine_tune(lora, 4)
    # config.json is the config the run used, resolved once before the model was built: the
    # platform's steps per call (auto), the preset, and what packed text takes from both.
    recorded = json.loads((full / "config.json").read_text())
    assert "float32, 2 steps per execution" in trained, trained[-2000:]
    assert recorded["train"]["steps_per_execution"] == 2, recorded["train"]
    assert recorded["model"]["preset"] == recorded["data"]["tokens"]["vocabulary"] == str(checkpoint), recorded
    assert recorded["data"]["tokens"]["context_length"] == 32, recorded["data"]
    assert recorded["data"]["tokens"]["counts"] == str(full / "token_counts"), recorded["data"]
    assert os.listdir(full / "token_counts")  # where the run counted its tokens
    for workdir in (full, lora):
        kept = sorted(os.listdir(workdir / "model"))
        assert "config.json" in kept and "tokenizer.json" in kept, kept
        assert not any(name.endswith(".safetensors") for name in kept), kept  # no second copy
    assert not (full / "base.json").exists()  # its checkpoints hold every weight
    assert json.loads((lora / "base.json").read_text())["files"] == ["model.safetensors"]

    def assert_same_figures(workdir):
        ran, evaluated = scalars(workdir / "tensorboard"), scalars(workdir / "tensorboard" / "eval")
        assert evaluated and all(abs(value - ran[key]) <= 1e-5 for key, value in evaluated.items()), (
            evaluated, ran)

    original = (checkpoint / "config.json").read_text()
    config = json.loads(original)
    (checkpoint / "config.json").write_text(json.dumps({**config, "rope_theta": config["rope_theta"] / 2}))
    edited = run_in_one_process("tpu_keras.evaluate", {  # one start of TensorFlow and keras-hub
        name: [f"--workdir={workdir}", "--step=4"] for name, workdir in (("full", full), ("lora", lora))})
    assert edited["full"].returncode == 0, edited["full"].stdout[-3000:] + edited["full"].stderr[-3000:]
    assert_same_figures(full)
    assert_one_line_error(edited["lora"], f"model.preset='{checkpoint}' is "
                          f"not the model this run started with (kept in {lora / 'model'}), and "
                          f"{lora}'s checkpoints hold its LoRA adapters alone: put the original back")
    (checkpoint / "config.json").write_text(original)
    evaluate(lora, "--step=4")
    assert_same_figures(lora)
    run_command([sys.executable, "-m", "tpu_keras.export", f"--workdir={lora}", "--step=4", "--formats=peft"])
    # The PEFT adapter names the checkpoint the run started from.
    adapter = json.loads((lora / "export" / "peft" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(checkpoint), adapter
    assert not (lora / "export" / "peft_base").exists()

    shutil.rmtree(checkpoint)  # export then builds the full fine-tune from DIR/model alone
    shutil.rmtree(full / "export")
    exports = run_in_one_process("tpu_keras.export", {
        "full": [f"--workdir={full}", "--step=4", "--formats=transformers"],
        "gone": [f"--workdir={lora}", "--step=4"]})
    assert exports["full"].returncode == 0, exports["full"].stdout[-3000:] + exports["full"].stderr[-3000:]
    exported = json.loads((full / "export" / "transformers" / "config.json").read_text())
    assert exported["rope_theta"] == config["rope_theta"], exported  # the run's, not the edit's
    assert_one_line_error(exports["gone"], "its base comes from model.preset again", "does not exist")
