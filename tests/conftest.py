"""Helpers to run the toolkit the way users do: as bounded subprocesses.

Every device layout runs in its own process (TensorFlow fixes its devices at
start-up), and every process is bounded by a timeout.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tpu_keras.measurement import peak

REPO = Path(__file__).resolve().parents[1]

# Test modules by CPU time, slowest first (one full run on the 2-core machine).
# xdist's loadscope hands whole modules to the workers in collection order, so
# starting with the longest lets the short ones fill in at the end, and both
# workers finish together instead of one running a long module alone.
SLOWEST_FIRST = ("test_hub.py", "test_multislice.py", "test_parallel.py", "test_plan.py", "test_steps.py",
                 "test_data.py", "test_reliability.py", "test_train.py", "test_user_code.py",
                 "test_hub_transformers.py", "test_accumulation.py", "test_nonfinite.py",
                 "test_host_failure.py", "test_engines.py", "test_workdir.py", "test_errors.py",
                 "test_evaluate.py", "test_builders.py", "test_cluster.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a module


def run(args, *, timeout=300, env=None, check=True, merge_stderr=True, cwd=REPO):
    """Runs `args` (from the repo root unless `cwd` says otherwise); returns the
    CompletedProcess (text; stderr merged into stdout unless `merge_stderr=False`)."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("TF_CONFIG", None)
    result = subprocess.run(args, cwd=cwd, env=full_env, timeout=timeout, text=True,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {result.returncode}:\n{result.stdout[-4000:]}")
    return result


def assert_one_line_error(result, *fragments):
    """A user mistake: non-zero exit, one `error: ...` line holding `fragments`, no traceback."""
    assert result.returncode != 0
    assert "Traceback" not in result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stdout[-3000:]
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


def train(config, workdir, *overrides, timeout=300, check=True, env=None):
    return run([sys.executable, "-m", "tpu_keras.train", f"--config={config}",
                f"--workdir={workdir}", *overrides], timeout=timeout, check=check, env=env)


@pytest.fixture(scope="session", autouse=True)
def own_peak_cache(tmp_path_factory):
    """A matmul-ceiling cache of the suite's own: measured on a machine busy with tests,
    it would understate the user's ceiling and overstate their MFU."""
    os.environ[peak.CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("tpu_keras_cache"))


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """One TFDS data_dir for the session, so each offline dataset is prepared once."""
    return str(tmp_path_factory.mktemp("tensorflow_datasets"))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, data_dir):
    """One finished `configs/lm_stdlib.py:tiny` run (20 steps, steps 11-12 profiled):
    (workdir, output).

    Tests read it; a test that would change it copies what it needs first.
    """
    workdir = tmp_path_factory.mktemp("lm_tiny")
    result = train("configs/lm_stdlib.py:tiny", workdir, f"--config.data.data_dir={data_dir}",
                   "--config.log.profile_steps=(11, 12)")
    return workdir, result.stdout


@pytest.fixture(scope="session")
def stdlib_text(data_dir):
    """The standard library as .txt documents with its 1,024-piece SentencePiece
    vocabulary (trained offline with SentencePiece), written once into `data_dir`;
    returns their folder."""
    run([sys.executable, "-c", "import sys; from tpu_keras.data import stdlib_text; "
         "print(stdlib_text.prepare(sys.argv[1]))", data_dir], timeout=300)
    return Path(data_dir) / "stdlib_text"
