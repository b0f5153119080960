"""Helpers to run the toolkit the way users do: as bounded subprocesses.

Every device layout runs in its own process (TensorFlow fixes its devices at
start-up), and every process is bounded by a timeout.

`tests/` holds only this file and the test modules (`test_*.py`); everything else
lives in `tests/helpers/`: the probes, programs the tests start as subprocesses
(`python tests/helpers/mesh_probe.py ...`, each device layout in a process of its
own), and the modules tests import (`resume`, `pods`, `placements`, ...). This file
puts `tests/helpers` on `sys.path` for the test modules; a probe run as a script
finds the helpers beside it (a script's own folder is `sys.path[0]`). The helpers
that import `conftest` (`resume`, `pods`, `shipped`) are imported by tests (and this
file's fixtures) only, where pytest has put `tests/` on the path to import this file.
"""

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tpu_keras.measurement import peak

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))  # the helpers the test modules import

# XLA:CPU's LLVM passes at -O0 in every process of the suite (this one and those it starts,
# which inherit the variable; `run_command` keeps it beside a test's own XLA_FLAGS). The
# suite's programs are tiny and run a few steps, so compiling them is much of their time:
# the fast tier took a tenth less CPU with it, one run beside the other on a 2-core machine
# (331 s against 369 s), the MoE probe a sixth less. It changes how XLA:CPU optimises the machine
# code, not the HLO passes that partition a program over devices, nor the TPU compiler's
# figures (libtpu's own XLA).
SUITE_XLA_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SUITE_XLA_FLAGS}".strip()

# Test modules by CPU time, slowest first (one full run on the 2-core machine).
# xdist's loadscope hands whole modules to the workers in collection order, so
# starting with the longest lets the short ones fill in at the end, and both
# workers finish together instead of one running a long module alone.
SLOWEST_FIRST = ("test_moe.py", "test_moe_families_on_expert_meshes.py",
                 "test_newer_families.py", "test_newer_families_on_a_mesh.py", "test_shipped_configs.py",
                 "test_grpo.py", "test_evaluate.py", "test_memory.py", "test_multislice.py",
                 "test_hub_transformers.py", "test_hub.py", "test_lora_checkpoints.py", "test_tpu_pod.py",
                 "test_parallel.py", "test_context.py", "test_chunked_loss.py",
                 "test_plan.py", "test_steps.py", "test_preference.py", "test_packing.py", "test_data.py",
                 "test_reliability.py", "test_train.py", "test_user_code.py",
                 "test_lora.py", "test_quantize.py", "test_accumulation.py", "test_nonfinite.py",
                 "test_host_failure.py", "test_tpu_compiler.py", "test_step_cache.py", "test_benchmark.py",
                 "test_families.py", "test_engines.py", "test_tpu_topologies.py",
                 "test_workdir.py", "test_errors.py", "test_builders.py", "test_cluster.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a module


def run_command(args, *, timeout=300, env=None, check=True, merge_stderr=True, cwd=REPO):
    """Runs `args` (from the repo root unless `cwd` says otherwise); returns the
    CompletedProcess (text; stderr merged into stdout unless `merge_stderr=False`)."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", **(env or {})}
    if "XLA_FLAGS" in (env or {}):  # the test's flags (a device count) and the suite's
        full_env["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {env['XLA_FLAGS']}"
    full_env.pop("TF_CONFIG", None)
    result = subprocess.run(args, cwd=cwd, env=full_env, timeout=timeout, text=True,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {result.returncode}:\n{result.stdout[-4000:]}")
    return result


def run_in_one_process(command, calls, *, timeout=300):
    """Several command lines of one toolkit `command` ('tpu_keras.plan'), run in one
    process by tests/helpers/cli_batch.py: {name: CompletedProcess}, `stdout` and `stderr` apart."""
    output = run_command([sys.executable, "tests/helpers/cli_batch.py", command, json.dumps(calls)],
                         timeout=timeout, merge_stderr=False).stdout
    done = [json.loads(line[len("CALL "):]) for line in output.splitlines() if line.startswith("CALL ")]
    return {call["name"]: subprocess.CompletedProcess(calls[call["name"]], call["code"], call["stdout"],
                                                      call["stderr"]) for call in done}


def assert_one_line_error(result, *fragments):
    """A user mistake: non-zero exit, one `error: ...` line holding `fragments`, no traceback
    (in stdout and stderr together, where the result keeps them apart)."""
    assert result.returncode != 0
    output = result.stdout + (result.stderr or "")
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


# The launcher's line where the kernel refuses it a private network namespace.
NO_PRIVATE_NETWORK = "notice: no private network here"


def skip_without_private_network(output):
    """Skips a test of the private network where the launcher's `output` says the
    kernel refused one: CI machines may forbid unprivileged user namespaces."""
    refused = re.search(re.escape(NO_PRIVATE_NETWORK) + r" \((.*?)\)", output)
    if refused:
        pytest.skip(f"no unprivileged network namespaces on this machine ({refused.group(1)})")


def reachable(port):
    """Whether this process, outside any launcher's private network, connects to 127.0.0.1:`port`."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return True
    except ConnectionRefusedError:
        return False


def train_args(config, workdir, *overrides) -> list:
    """The arguments of `python -m tpu_keras.train` (for `train`, or for one call of
    `run_in_one_process("tpu_keras.train", ...)`)."""
    return [f"--config={config}", f"--workdir={workdir}", *overrides]


def train(config, workdir, *overrides, timeout=300, check=True, env=None):
    return run_command([sys.executable, "-m", "tpu_keras.train", *train_args(config, workdir, *overrides)],
                       timeout=timeout, check=check, env=env)


@pytest.fixture(scope="session", autouse=True)
def own_peak_cache(tmp_path_factory):
    """The user cache folder of the suite's own, one for both workers: the matmul ceiling
    (measured on a machine busy with tests, it would understate the user's ceiling and
    overstate their MFU) and the compile cache of runs that keep the default, whose
    programs the two workers then compile once between them. Tests of the cache itself
    give their runs a folder of their own."""
    folder = shared_tmp(tmp_path_factory) / "tpu_keras_cache"
    folder.mkdir(exist_ok=True)
    os.environ[peak.CACHE_DIR_ENV] = str(folder)


def shared_tmp(tmp_path_factory) -> Path:
    """A folder every xdist worker of this pytest run sees (each worker's own basetemp
    is a child of it), so a session fixture can be made once for the whole suite."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once_per_suite(tmp_path_factory, name, make):
    """`make()`'s JSON-able result, made by the first worker to ask and read by the rest."""
    root = shared_tmp(tmp_path_factory)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait here while the first makes it
        done = root / f"{name}.json"
        if not done.exists():
            done.write_text(json.dumps(make()))
        return json.loads(done.read_text())


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """One TFDS data_dir for the whole suite, so each offline dataset is prepared once
    (the toolkit's preparation is safe for hosts, and so workers, that share one)."""
    path = shared_tmp(tmp_path_factory) / "tensorflow_datasets"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, data_dir):
    """One finished `configs/lm_stdlib.py:tiny` run (20 steps, steps 11-12 profiled):
    (workdir, output).

    Tests read it; a test that would change it copies what it needs first.
    """
    def make():
        workdir = shared_tmp(tmp_path_factory) / "lm_tiny"
        result = train("configs/lm_stdlib.py:tiny", workdir, f"--config.data.data_dir={data_dir}",
                       "--config.log.profile_steps=(11, 12)")
        return str(workdir), result.stdout
    workdir, output = once_per_suite(tmp_path_factory, "lm_tiny", make)
    return Path(workdir), output


@pytest.fixture(scope="session")
def grpo_warm_start(tmp_path_factory):
    """configs/grpo_stdlib.py's documented warm start (its :sft command), run once for the
    suite as its docstring shows it, on an empty home, FOLDER/home, into FOLDER/arithmetic_sft:
    {"folder", "command", "code", "output"}. The shipped-config test runs GRPO's :tiny command
    beside a copy of it, and tests/test_grpo.py's runs start from another."""
    def make():
        from shipped import chosen_and_before, empty_home_env, in_folder, run_as_documented
        folder = shared_tmp(tmp_path_factory) / "grpo_warm_start"
        (folder / "home").mkdir(parents=True)
        command = in_folder(chosen_and_before("grpo_stdlib")[0], folder)
        result = run_as_documented(command, empty_home_env(folder / "home"))
        return {"folder": str(folder), "command": command, "code": result.returncode,
                "output": result.stdout[-4000:]}
    return once_per_suite(tmp_path_factory, "grpo_warm_start", make)


@pytest.fixture(scope="session")
def stdlib_text(tmp_path_factory, data_dir):
    """The standard library as .txt documents with its 1,024-piece SentencePiece
    vocabulary (trained offline with SentencePiece), written once into `data_dir`;
    returns their folder."""
    once_per_suite(tmp_path_factory, "stdlib_text", lambda: run_command(
        [sys.executable, "-c", "import sys; from tpu_keras.data import stdlib_text; "
         "print(stdlib_text.prepare(sys.argv[1]))", data_dir], timeout=300).stdout)
    return Path(data_dir) / "stdlib_text"
