"""End-to-end tests of the local pod simulator, run as a real subprocess."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import NO_PRIVATE_NETWORK, assert_one_line_error, reachable, run_command, \
    skip_without_private_network

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("TF_CONFIG", None)
    return env


def _launch_argv(flags, child_code):
    return [sys.executable, "-m", "tpu_keras.launch", *flags, "--",
            sys.executable, "-c", textwrap.dedent(child_code)]


def _run(flags, child_code, timeout=30):
    """Runs the launcher; returns (exit code, merged output, seconds taken)."""
    start = time.monotonic()
    result = subprocess.run(
        _launch_argv(flags, child_code), cwd=REPO_ROOT, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return result.returncode, result.stdout, time.monotonic() - start


def _is_gone(pid):
    """True if `pid` no longer runs (a not-yet-reaped zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _wait_gone(pid, seconds=5):
    deadline = time.monotonic() + seconds
    while not _is_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _is_gone(pid)


def _wait_for_file(path, seconds=20):
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return int(path.read_text())


# A child that records its PID as pid<host>.txt, then sleeps for a minute.
_SLEEPER = """
    import os, pathlib, time
    index = os.environ["TPU_KERAS_HOST_INDEX"]
    path = pathlib.Path({tmp!r}) / f"pid{{index}}.txt"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)
    time.sleep(60)
"""


def test_two_hosts_get_consistent_cluster_env():
    code, out, _ = _run(["--hosts=2", "--devices_per_host=3"], """
        import json, os, sys
        config = json.loads(os.environ["TF_CONFIG"])
        print("TASK", config["task"]["index"], os.environ["TPU_KERAS_VIRTUAL_DEVICES"])
        print("WORKERS", json.dumps(config["cluster"]["worker"]))
        print("to stderr", file=sys.stderr)
    """)
    assert code == 0, out
    assert "[host 0] TASK 0 3" in out
    assert "[host 1] TASK 1 3" in out
    assert "[host 0] to stderr" in out and "[host 1] to stderr" in out
    workers = [json.loads(line.split("WORKERS ", 1)[1])
               for line in out.splitlines() if "WORKERS " in line]
    assert len(workers) == 2 and workers[0] == workers[1]
    ports = {address.rsplit(":", 1)[1] for address in workers[0]}
    assert len(ports) == 2
    assert re.search(r"all hosts succeeded .* in [\d.]+ s", out), out


def test_slices_of_hosts_are_numbered_across_slices_and_told_their_slice():
    code, out, _ = _run(["--slices=2", "--hosts=2"], """
        import json, os
        config = json.loads(os.environ["TF_CONFIG"])
        print("HOST", config["task"]["index"], len(config["cluster"]["worker"]),
              os.environ["TPU_KERAS_NUM_HOSTS"], os.environ["TPU_KERAS_SLICE"],
              os.environ["TPU_KERAS_NUM_SLICES"])
    """)
    assert code == 0, out
    for host in range(4):
        assert f"[host {host}] HOST {host} 4 4 {host // 2} 2" in out, out
    assert re.search(r"hosts started: host 0 pid \d+ \(slice 0\), .* host 3 pid \d+ \(slice 1\)", out), out
    assert "all hosts succeeded (slices=2, hosts=2 per slice" in out, out


def test_single_host_has_no_tf_config():
    code, out, _ = _run(["--devices_per_host=2"], """
        import os
        print("HAS_TF_CONFIG", "TF_CONFIG" in os.environ, os.environ["TPU_KERAS_NUM_HOSTS"])
    """)
    assert code == 0, out
    assert "[host 0] HAS_TF_CONFIG False 1" in out


def test_failing_host_stops_the_others(tmp_path):
    # Host 1 fails only once host 0 has recorded its PID, so we can check it died.
    fail_after_host0 = textwrap.dedent("""
        import os, pathlib, sys, time
        tmp = pathlib.Path({tmp!r})
        if os.environ["TPU_KERAS_HOST_INDEX"] == "1":
            while not (tmp / "pid0.txt").exists():
                time.sleep(0.05)
            sys.exit(3)
    """)
    child = fail_after_host0 + textwrap.dedent(_SLEEPER)
    code, out, seconds = _run(["--hosts=2", "--failure_grace=1"], child.format(tmp=str(tmp_path)))
    assert code == 3, out
    assert seconds < 30, out
    assert "host 1 failed first, with exit code 3" in out
    assert "the run failed: host 1 failed first" in out
    assert _wait_gone(int((tmp_path / "pid0.txt").read_text())), out


def test_timeout_kills_all_hosts(tmp_path):
    code, out, seconds = _run(["--hosts=2", "--timeout=3"], _SLEEPER.format(tmp=str(tmp_path)))
    assert code == 124, out
    assert seconds < 30, out
    assert "timed out after 3 s" in out
    for index in range(2):
        assert _wait_gone(int((tmp_path / f"pid{index}.txt").read_text())), out


def test_sigterm_to_launcher_stops_hosts(tmp_path):
    launcher = subprocess.Popen(
        _launch_argv(["--hosts=2"], _SLEEPER.format(tmp=str(tmp_path))),
        cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pids = [_wait_for_file(tmp_path / f"pid{index}.txt") for index in range(2)]
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, out
    assert all(_wait_gone(pid) for pid in pids), out


@pytest.mark.parametrize("flags", [["--hosts=2"], ["--hosts=0", "--"], ["--devices_per_host=0", "--"],
                                   ["--network=none", "--"], ["--slices=0", "--"],
                                   ["--tpu=v9-16", "--"], ["--tpu=v5litepod-16", "--hosts=2", "--"]])
def test_bad_usage_is_one_line(flags):
    argv = [sys.executable, "-m", "tpu_keras.launch", *flags]
    if "--" in flags:
        argv.append("true")
    result = subprocess.run(argv, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=30)
    assert result.returncode != 0
    assert "Traceback" not in result.stdout
    assert len(result.stdout.strip().splitlines()) == 1, result.stdout


# A child that listens on its TF_CONFIG port on every interface, as TensorFlow's
# servers do, checks it can connect to it itself, says so, and waits for `done`.
_LISTENER = """
    import json, os, pathlib, socket, time
    config = json.loads(os.environ["TF_CONFIG"])
    port = int(config["cluster"]["worker"][config["task"]["index"]].rsplit(":", 1)[1])
    server = socket.create_server(("", port))
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    print("LISTENING", port, flush=True)
    done, deadline = pathlib.Path({tmp!r}) / "done", time.monotonic() + 30
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


@pytest.mark.parametrize("network, in_reach", [("private", False), ("host", True)])
def test_the_hosts_ports_are_out_of_reach_unless_on_the_host_network(tmp_path, network, in_reach):
    launcher = subprocess.Popen(
        _launch_argv(["--hosts=2", "--timeout=60", f"--network={network}"],
                     _LISTENER.format(tmp=str(tmp_path))),
        cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in launcher.stdout:  # until both hosts listen (they give up after 30 s)
            lines.append(line)
            if sum("LISTENING" in line for line in lines) == 2:
                break
        ports = [int(line.split()[-1]) for line in lines if "LISTENING" in line]
        found = {port: reachable(port) for port in ports}
        (tmp_path / "done").write_text("")
        out = "".join(lines) + launcher.communicate(timeout=30)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    if network == "private":
        skip_without_private_network(out)
    assert launcher.returncode == 0, out
    assert len(ports) == 2 and found == {port: in_reach for port in ports}, out
    assert NO_PRIVATE_NETWORK not in out


# Execs the rest of its argv in a user namespace that maps no uid, where the kernel
# refuses a nested one (EPERM); where it refuses even this one, the launcher will too.
_UNMAPPED_USER_NAMESPACE = """
import os, sys
from tpu_keras.cluster import private_network
try:
    private_network._unshare(private_network.CLONE_NEWUSER)
except OSError:
    pass
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def test_where_namespaces_are_refused_one_line_says_what_is_exposed():
    argv = [sys.executable, "-c", _UNMAPPED_USER_NAMESPACE,
            *_launch_argv(["--hosts=2"], "print('RAN')")[1:]]
    result = subprocess.run(argv, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=60)
    assert result.returncode == 0, result.stdout
    assert "[host 0] RAN" in result.stdout and "[host 1] RAN" in result.stdout
    notices = [line for line in result.stdout.splitlines() if NO_PRIVATE_NETWORK in line]
    assert len(notices) == 1, result.stdout
    for fragment in ("listen on all interfaces", "without authentication", "user namespaces",
                     "firewall"):
        assert fragment in notices[0], notices[0]


def test_a_command_that_names_another_machine_needs_the_host_network():
    result = run_command([sys.executable, "-m", "tpu_keras.launch", "--hosts=2", "--", "true",
                  "--workdir=gs://bucket/run"], timeout=30, check=False)
    assert_one_line_error(result, "gs://bucket/run", "--network=host")
