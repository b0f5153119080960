"""The step cache (jax engine): a step loads whole, untraced, only while nothing that
decides its program has changed; anything else is a miss that compiles as before."""

import importlib
import json
import os
import sys

import pytest

from conftest import run_command
from tpu_keras.training import step_cache

PROBE = """
import json, os, sys, jax, jax.numpy as jnp
from absl import logging
from tpu_keras.training import step_cache
logging.set_verbosity(logging.INFO)
folder, with_jax_cache, loaded = sys.argv[1], sys.argv[2] == "1", []
if with_jax_cache:
    jax.config.update("jax_compilation_cache_dir", folder + "_jax")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.monitoring.register_event_listener(
    lambda event, **_: loaded.append(event) if event == step_cache.LOADED_EVENT else None)

def step(state, batch):
    return {"loss": jnp.sum(batch * state)}, state + batch.mean()

def call(config="{}", size=8):
    # A new process as far as the caches know: no jitted program in memory, a new CachedStep.
    jax.clear_caches()
    cached = step_cache.CachedStep(jax.jit(step, donate_argnums=0), "train", folder, config)
    logs, state = cached(jnp.full((), 2.0), jnp.arange(float(size)))
    print("CALL", json.dumps({"loaded": len(loaded), "loss": float(logs["loss"]), "state": float(state)}))

if with_jax_cache:
    call('{"run": 1}')       # compiled by XLA, kept
    call('{"run": 2}')       # the same program: JAX's cache serves it, not kept
    call('{"run": 2}')       # so compiled (served) again
    call('{"run": 1}')       # loaded whole
    sys.exit()
call()                       # compiled, kept
call()                       # loaded whole
with open(os.path.join(folder, os.listdir(folder)[0]), "wb") as f:
    f.write(b"torn")
call()                       # an unreadable entry: compiled again, kept again
call()                       # loaded
call(config='{"lr": 2}')     # another config: compiled
call(size=4)                 # other shapes: another entry, compiled
switching = step_cache.CachedStep(jax.jit(step), "train", folder, "{}")
switching(jnp.full((), 2.0), jnp.arange(8.0))   # loaded; then other shapes: plain jax.jit
print("SWITCHED", float(switching(jnp.full((), 2.0), jnp.arange(4.0))[0]["loss"]))
"""


def in_a_file(code, tmp_path):
    """`code` as a script: a step that lives in no file is never kept (test below)."""
    script = tmp_path / "probe.py"
    script.write_text(code)
    return str(script)


def probe(folder, with_jax_cache):
    result = run_command([sys.executable, in_a_file(PROBE, folder.parent), str(folder), str(int(with_jax_cache))],
                         env={"KERAS_BACKEND": "jax"}, merge_stderr=False)
    calls = [json.loads(line[5:]) for line in result.stdout.splitlines() if line.startswith("CALL ")]
    return result, calls


@pytest.mark.slow
def test_a_step_loads_whole_until_its_config_shapes_or_entry_change(tmp_path):
    folder = tmp_path / "steps"
    result, calls = probe(folder, with_jax_cache=False)
    assert [c["loaded"] for c in calls] == [0, 1, 1, 2, 2, 2], result.stdout + result.stderr[-3000:]
    assert {(c["loss"], c["state"]) for c in calls[:5]} == {(56.0, 5.5)}  # the same program
    assert (calls[5]["loss"], calls[5]["state"]) == (12.0, 3.5)
    assert "SWITCHED 12.0" in result.stdout
    torn = [line for line in result.stderr.splitlines() if "not a readable entry" in line]
    assert len(torn) == 1 and "compiling the step" in torn[0], result.stderr[-3000:]
    assert len(os.listdir(folder)) == 3  # one entry per config and shapes


@pytest.mark.slow
def test_a_step_that_jax_s_own_cache_served_is_not_kept(tmp_path):
    # XLA:CPU serializes such an executable without its kernels; kept, it would fail to run.
    folder = tmp_path / "steps"
    result, calls = probe(folder, with_jax_cache=True)
    assert [c["loaded"] for c in calls] == [0, 0, 0, 1], result.stdout + result.stderr[-3000:]
    assert {(c["loss"], c["state"]) for c in calls} == {(56.0, 5.5)}
    assert len(os.listdir(folder)) == 1
    assert result.stderr.count("not kept whole (JAX's cache served it)") == 2, result.stderr[-3000:]


def test_an_entry_is_stale_once_a_file_loaded_at_its_trace_changes(tmp_path, monkeypatch):
    module = tmp_path / "user_model.py"
    module.write_text("WIDTH = 64\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("user_model")
    try:
        recorded = step_cache.loaded_sources()
        assert str(module) in recorded
        assert step_cache.stale_sources(recorded) is None
        module.write_text("WIDTH = 128\n")  # an edit of the user's own model code
        assert step_cache.stale_sources(recorded) == f"{module} changed"
        module.unlink()
        assert step_cache.stale_sources(recorded) == f"{module} is gone"
    finally:
        sys.modules.pop("user_model", None)


MESH_ORDER_PROBE = """
import json, sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tpu_keras.training import step_cache
devices = jax.devices()
mesh = Mesh(np.array([devices[i] for i in (2, 0, 3, 1)]), ("data",))  # a TPU's kind of order
batch = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, PartitionSpec("data")))
state = jax.device_put(jnp.full((), 2.0), NamedSharding(mesh, PartitionSpec()))
for _ in range(2):  # compiled and kept, then loaded whole
    jax.clear_caches()
    cached = step_cache.CachedStep(jax.jit(lambda s, b: ({"loss": jnp.sum(b * s)}, s + b.mean())),
                                   "train", sys.argv[1], "{}")
    logs, _ = cached(state, batch)
    print("CALL", float(logs["loss"]), flush=True)
"""


@pytest.mark.slow
def test_a_step_on_a_mesh_in_another_device_order_loads_for_that_order(tmp_path):
    """On a TPU the mesh does not list devices in JAX's order. A kept step must run on its
    mesh's devices as compiled: loaded in JAX's order, it aborted the process."""
    result = run_command([sys.executable, in_a_file(MESH_ORDER_PROBE, tmp_path), str(tmp_path / "steps")],
                         env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"})
    assert result.stdout.count("CALL 56.0") == 2, result.stdout[-3000:]
    assert len(os.listdir(tmp_path / "steps")) == 1


FILELESS_PROBE = """
import sys, jax, jax.numpy as jnp
from absl import logging
from tpu_keras.training import step_cache
logging.set_verbosity(logging.INFO)
factor = float(sys.argv[2])
def step(state, batch):  # code that lives in no file: `python -c`, as a notebook cell
    return {"loss": jnp.sum(batch * state) * factor}, state
cached = step_cache.CachedStep(jax.jit(step), "train", sys.argv[1], "{}")
print("CALL", float(cached(jnp.full((), 2.0), jnp.arange(4.0))[0]["loss"]), flush=True)
"""


@pytest.mark.slow
def test_a_step_whose_code_lives_in_no_file_is_never_served_from_the_cache(tmp_path):
    """Same config, same shapes, other code: each process computes with its own code (a kept
    step would have served the first one's program to the second)."""
    folder = tmp_path / "steps"
    first, second = (run_command([sys.executable, "-c", FILELESS_PROBE, str(folder), factor], merge_stderr=False,
                                 env={"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}) for factor in ("1", "2"))
    assert "CALL 12.0" in first.stdout and "CALL 24.0" in second.stdout, first.stdout + second.stdout
    assert "lives in no file" in second.stderr, second.stderr[-2000:]
    assert not folder.exists() or not os.listdir(folder)


def test_the_key_covers_the_model_s_architecture_and_compiled_constants():
    import keras
    from tpu_keras.models.metrics import bits_per_byte

    def described(units=3, scale=0.5):
        keras.backend.clear_session()  # the layers' names as in a new process
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units)])
        model.compile(loss="mse", metrics=[bits_per_byte(scale)], optimizer="adam")
        return step_cache.describe_model(model)
    assert described() == described()
    assert described(units=5) != described()  # a preset's changed value, say
    assert described(scale=0.25) != described()  # a corpus with other tokens per byte


def test_ipython_imported_is_no_shell_and_only_a_shell_s_trace_is_watched():
    # kagglehub, keras-hub's download client, imports IPython in every script: that alone
    # must not make a script's trace watched (2.5x slower) and its steps never kept.
    import IPython  # noqa: F401 -- imported, as kagglehub leaves it
    from IPython.core.interactiveshell import InteractiveShell
    assert not step_cache._in_a_shell()
    main = sys.modules["__main__"]
    InteractiveShell.instance()  # a notebook's or IPython's shell, running in this process
    try:
        assert step_cache._in_a_shell() and step_cache._interactive()
    finally:
        InteractiveShell.clear_instance()
        sys.modules["__main__"] = main  # the shell put its own namespace there
    assert not step_cache._in_a_shell()


def test_a_trace_under_another_profiler_keeps_it_and_is_not_kept():
    # cProfile, a debugger: the step's code cannot be watched, so it counts as code in no
    # file (no entry), and the other tool's hook stays in place.
    seen = []

    def other(frame, event, arg):
        seen.append(event)

    sys.setprofile(other)
    try:
        result, traced = step_cache._tracing_code(lambda: 7)
        still = sys.getprofile()
    finally:
        sys.setprofile(None)
    assert result == 7 and still is other and seen
    assert step_cache.code_without_a_file(traced) == f"{step_cache.WATCHED_BY_ANOTHER} in no module"
