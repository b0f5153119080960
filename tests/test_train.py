"""End-to-end runs of `python -m tpu_keras.train` on the offline datasets."""

import glob
import json
import os
import re
import sys

import pytest

from conftest import run_command, train
from resume import assert_same_weights, killed_after_checkpoint_then_resumed
from test_evaluate import assert_same_validation

LM_TINY = "configs/lm_stdlib.py:tiny"


def logged_steps(output):
    return [int(s) for s in re.findall(r"step (\d+)/\d+ \|", output)]


def test_tiny_run_writes_config_events_checkpoints_and_export(tiny_run):
    workdir, output = tiny_run
    assert logged_steps(output) == [10, 20]
    assert re.search(r"val_bits_per_byte [\d.]+ .*tokens_per_second [\d,]+", output)
    assert (workdir / "config.json").exists()
    events = glob.glob(str(workdir / "tensorboard" / "events.out.tfevents.*"))
    assert events
    # Model FLOP/s and MFU, in the log and in TensorBoard (tag names are stored verbatim).
    assert re.search(r"model_flops_per_second [\d.e+]+ \| mfu \d+\.\d+", output), output[-2000:]
    assert b"mfu" in open(events[0], "rb").read()
    # The global gradient norm, which the NaN guard watches too.
    assert re.search(r"grad_norm \d[\d.e+-]* ", output) and b"grad_norm" in open(events[0], "rb").read()
    # The learning rate, as every trainer logs it: the schedule's, after warmup and decay.
    rates = [float(r) for r in re.findall(r"step \d+/20 \| .*learning_rate ([\d.e-]+) \|", output)]
    assert len(rates) == 2 and rates[1] < rates[0], rates
    assert b"learning_rate" in open(events[0], "rb").read()
    assert (workdir / "checkpoints" / "ckpt-20.index").exists()
    assert (workdir / "export" / "saved_model.pb").exists()


def assert_profiled(workdir, output):
    """A TensorBoard profile of steps 11-12 (the execution 11-15), where its plugin looks."""
    assert re.search(r"profiling from step 11 into \S+tensorboard", output), output[-2000:]
    traces = glob.glob(str(workdir / "tensorboard" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert traces and all(os.path.getsize(t) > 0 for t in traces), traces


def test_profile_steps_trace_the_chosen_steps(tiny_run):
    assert_profiled(*tiny_run)


@pytest.mark.slow
def test_plot_run_draws_loss_throughput_and_mfu(tiny_run, tmp_path):
    workdir, _ = tiny_run
    out = tmp_path / "run.png"
    result = run_command([sys.executable, "scripts/plot_run.py", str(workdir), f"--out={out}"])
    drawn = result.stdout.strip().splitlines()[-1]
    for tag in ("loss", "val_loss", "grad_norm", "examples_per_second", "mfu"):
        assert re.search(rf"\b{tag}\b", drawn), drawn
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
def test_mixed_bfloat16_trains_and_says_so(tmp_path, data_dir):
    # The digits MLP: XLA compiles it in seconds; the policy is the same for every model.
    output = train("configs/digits.py:tiny", tmp_path, "--config.train.precision=mixed_bfloat16",
                   "--config.train.jit_compile=True", f"--config.data.data_dir={data_dir}").stdout
    assert "mixed_bfloat16, 5 steps per execution, XLA" in output
    assert json.loads((tmp_path / "config.json").read_text())["train"]["precision"] == "mixed_bfloat16"
    assert re.search(r"step 20/20 .*mfu \d+\.\d+", output)
    # It learns under bf16: well above the 0.1 of a guess (0.85 when measured).
    assert float(re.findall(r"val_accuracy ([\d.]+)", output)[-1]) >= 0.5, output[-1500:]


def test_export_predicts_like_the_keras_model(tiny_run):
    workdir, _ = tiny_run
    code = f"""
import numpy as np, tensorflow as tf
from ml_collections import config_flags
import sys; sys.path.insert(0, "configs")
import lm_stdlib
from tpu_keras import models
from tpu_keras.models import weight_paths
config = lm_stdlib.get_config("tiny")
model = models.build(config.model)
tf.train.Checkpoint(model_by_path=weight_paths.model_variables(model)).restore(
    r"{workdir}/checkpoints/ckpt-20").expect_partial()  # the model's weights, by path
tokens = np.random.default_rng(0).integers(0, 256, (3, config.model.context_length)).astype("int32")
exported = tf.saved_model.load(r"{workdir}/export")
np.testing.assert_allclose(exported.serve(tokens).numpy(), model(tokens).numpy(), atol=1e-5)
print("MATCH", float(np.abs(model(tokens).numpy()).sum()))
"""
    result = run_command([sys.executable, "-c", code])
    assert "MATCH" in result.stdout


@pytest.mark.slow
def test_two_hosts_train_four_replicas_and_end_with_identical_weights(tmp_path, data_dir):
    result = run_command([sys.executable, "-m", "tpu_keras.launch", "--hosts=2", "--devices_per_host=2",
                  "--timeout=400", "--", sys.executable, "-m", "tpu_keras.train",
                  "--config=configs/digits.py:tiny", f"--workdir={tmp_path}",
                  f"--config.data.data_dir={data_dir}"], timeout=450)
    for host in (0, 1):
        assert re.search(rf"\[host {host}\].*multi_worker strategy: 4 replica\(s\) on 2 host\(s\)",
                         result.stdout)
    fingerprints = dict(re.findall(r"\[host (\d)\].*weights fingerprint: (\S+)", result.stdout))
    assert len(fingerprints) == 2 and fingerprints["0"] == fingerprints["1"], fingerprints
    assert (tmp_path / "checkpoints" / "ckpt-20.index").exists()
    assert not (tmp_path / "tmp").exists() or not os.listdir(tmp_path / "tmp")


@pytest.mark.slow
def test_digits_reaches_95_percent_validation_accuracy_on_four_replicas(tmp_path, data_dir):
    result = train("configs/digits.py", tmp_path, f"--config.data.data_dir={data_dir}",
                   "--config.cluster.virtual_devices=4")
    assert "mirrored strategy: 4 replica(s) on 1 host(s)" in result.stdout
    assert logged_steps(result.stdout)[-1] == 600
    accuracy = float(re.findall(r"val_accuracy ([\d.]+)", result.stdout)[-1])
    print("digits val_accuracy", accuracy)
    assert accuracy >= 0.95


@pytest.mark.slow
def test_a_second_tf_start_reads_its_xla_programs_from_the_cache(tmp_path, data_dir):
    """TensorFlow reads its cache folder once, as it makes its devices: the run gives it the
    folder before that, so a run writes its XLA programs and a rerun reads them. TensorFlow
    keys a program on its names too, which count the functions traced before it in the
    process: the suite's first run also measures the machine's matmul ceiling (kept for
    later runs), so the run after it is the one a rerun repeats."""
    cache = tmp_path / "cache"
    args = (f"--config.data.data_dir={data_dir}", "--config.train.jit_compile=true",
            f"--config.train.compile_cache={cache}", "--config.train.steps=10")
    outputs, listings = [], []
    for name in ("first", "second", "third"):
        outputs.append(train("configs/digits.py:tiny", tmp_path / name, *args).stdout)
        listings.append(sorted(os.listdir(cache)))
    assert re.search(r"\| compile [\d.]+ \(compiled: not in the cache\)", outputs[0]), outputs[0][-2000:]
    assert listings[0] and all(name.startswith("xla_compile_cache") for name in listings[0])
    assert re.search(r"\| compile [\d.]+ \(from the cache\)", outputs[2]), (listings, outputs[2][-1000:])
    assert listings[2] == listings[1]  # the rerun compiled nothing anew


@pytest.fixture(scope="module")
def jax_run(tmp_path_factory, data_dir):
    """The digits on the jax engine, 20 steps, with a compile cache of its own (so that it
    compiles, and the runs after it load): (workdir, output, the flags of its runs)."""
    workdir = tmp_path_factory.mktemp("jax_run")
    # The compile cache comes last (a test replaces it); the same config throughout, so
    # that later runs load the steps this one keeps.
    args = ("--config.engine=jax", f"--config.data.data_dir={data_dir}",
            "--config.log.profile_steps=(11, 12)",
            f"--config.train.compile_cache={tmp_path_factory.mktemp('compile_cache')}")
    first = train("configs/digits.py:tiny", workdir, *args,
                  env={"JAX_LOG_COMPILES": "1"})  # JAX logs each program it compiles
    return workdir, first.stdout, args


@pytest.mark.slow
def test_the_same_config_trains_and_resumes_on_the_jax_engine(jax_run, tmp_path_factory):
    workdir, output, args = jax_run
    assert re.search(r"\| compile [\d.]+ \(compiled: not in the cache\)", output), output[-2000:]
    assert "jax mesh data=1 x model=1 over 1 process(es)" in output
    # Two epochs, each with a validation: on one device the steps compile once each (Keras's
    # uncommitted state used to compile the train step three times, the test step twice).
    for step in ("train_step", "test_step"):  # JAX's line: 'Compiling jit(train_step) with ...'
        assert len(re.findall(rf"Compiling (?:jit\()?{step}\b", output)) == 1, output[-3000:]
    assert logged_steps(output) == [10, 20]
    assert re.search(r"step 20/20 .*grad_norm \d[\d.e+-]* ", output), output[-2000:]
    events = glob.glob(str(workdir / "tensorboard" / "events.out.tfevents.*"))
    assert events and b"grad_norm" in open(events[0], "rb").read()
    assert_profiled(workdir, output)
    assert re.search(r"done at step 20: val_accuracy [\d.]+", output), output[-2000:]
    assert (workdir / "checkpoints" / "20").is_dir() and (workdir / "export" / "saved_model.pb").exists()
    # A compile cache that cannot be written: one warning, and the run goes on without it.
    blocker = tmp_path_factory.mktemp("blocked") / "a_file"
    blocker.write_text("")
    again = train("configs/digits.py:tiny", workdir, *args[:-1], "--config.train.steps=30",
                  f"--config.train.compile_cache={blocker / 'cache'}")
    warnings = [line for line in again.stdout.splitlines() if "cannot be written" in line]
    assert len(warnings) == 1 and "running without it" in warnings[0], again.stdout[-2000:]
    assert re.search(r"\| compile [\d.]+ \(no cache\)", again.stdout), again.stdout[-2000:]
    assert re.search(r"resumed from \S+ at step 20", again.stdout), again.stdout[-2000:]
    assert logged_steps(again.stdout) == [30]


@pytest.mark.slow
def test_a_jax_run_evaluates_on_another_mesh_and_resumes_from_the_compile_cache(jax_run, tmp_path_factory):
    workdir, _, args = jax_run
    # Evaluation as its own job, on another mesh: the run's own validation at step 10.
    run_command([sys.executable, "-m", "tpu_keras.evaluate", f"--workdir={workdir}", "--step=10",
         "--config.cluster.virtual_devices=2", "--config.mesh.model=2"])
    assert_same_validation(workdir, [10])
    # Killed after a checkpoint, rerun: the steps load from the compile cache, and the
    # weights end where the uninterrupted run's did.
    killed = tmp_path_factory.mktemp("killed")
    resumed = killed_after_checkpoint_then_resumed(
        [sys.executable, "-m", "tpu_keras.train", "--config=configs/digits.py:tiny",
         f"--workdir={killed}", *args], step=10)
    assert re.search(r"resumed from \S+ at step 10", resumed), resumed[-2000:]
    # The steps load whole (untraced): the killed and the resumed run reuse the fixture's.
    assert re.search(r"\| compile [\d.]+ \(from the cache, steps not traced\)", resumed), resumed[-2000:]
    assert re.search(r"train step: loaded from \S+, not traced", resumed), resumed[-2000:]
    cache = json.loads((killed / "timings.json").read_text())["compile_cache"]
    assert cache["programs"] >= 1 and cache["from_cache"] == cache["programs"], cache
    assert cache["steps_loaded"] >= 1 and cache["compile_seconds"] >= 0, cache
    assert_same_weights(killed, workdir, step=20)
