"""Simulates a multi-host pod on one machine by running one process per host.

    python -m tpu_keras.launch --hosts=2 --devices_per_host=4 -- python train.py
    python -m tpu_keras.launch --slices=2 --hosts=2 --devices_per_host=2 -- python train.py
    python -m tpu_keras.launch --tpu=v5litepod-16 -- python train.py

Each host gets the environment a real pod worker would see (TF_CONFIG for
the tf engine, a JAX coordinator address for the jax engine, and its index)
plus TPU_KERAS_VIRTUAL_DEVICES, which makes the cluster module split the CPU
into that many logical devices (fake JAX devices on the jax engine). So the same
multi-worker code path can be exercised on a laptop or in CI. With
`--slices=S` the pod is S slices of `--hosts` hosts each (a multislice job,
docs/running_on_a_tpu_pod.md, "Several slices"): hosts are numbered across slices, slice s holding hosts
s x hosts ... (s + 1) x hosts - 1, and each is told its slice in
TPU_KERAS_SLICE (and the count in TPU_KERAS_NUM_SLICES), where a real
multislice worker's TPU devices carry their `slice_index`. Output is merged
with a "[host i] " prefix. If one host fails, the launcher names it and gives
the others `--failure_grace` seconds to notice and exit on their own, as a
real pod's hosts must; then, or when the timeout passes, every host left is
stopped, so a broken run never leaves orphans or hangs its peers forever.
`--tpu=TYPE` takes the hosts, devices per host and slices from a TPU type
and tells each host the type (TPU_KERAS_SIMULATED_TPU): a jax run then lays
its mesh out in that slice's chip order, as libtpu describes it
(`cluster.libtpu`), so its hosts feed the batch rows they would on the slice.

The hosts' servers do not authenticate, so by default (`--network=private`)
the launcher first moves itself into a private network namespace
(`cluster.private_network`): the hosts, their coordinator and the local
tf.data service reach one another on 127.0.0.1, and nothing outside reaches
them. `--network=host` keeps them on this machine's network; where the kernel
refuses a namespace, the launcher says so in one line and goes on without.

Deliberately imports nothing heavy (no TensorFlow): it must start instantly.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import flags

from tpu_keras import cli
from tpu_keras.cluster import libtpu, private_network, topology
from tpu_keras.errors import UserError

flags.DEFINE_string("tpu", "", "A TPU type to simulate ('v5litepod-16', '2xv4-16'): its hosts, "
                    "its devices per host, its slices, and a jax mesh laid out in its chip order "
                    "(needs libtpu, the tpu extra). Sets --hosts, --slices and --devices_per_host.")
flags.DEFINE_integer("hosts", 1, "Number of simulated hosts (child processes) per slice.")
flags.DEFINE_integer("slices", 1, "Number of simulated TPU slices, --hosts hosts each "
                     "(TPU_KERAS_SLICE tells each host its slice).")
flags.DEFINE_integer("devices_per_host", 1,
                     "Logical CPU devices per host (TPU_KERAS_VIRTUAL_DEVICES).")
flags.DEFINE_float("timeout", 3600, "Seconds before all hosts are killed (exit 124).")
flags.DEFINE_float("failure_grace", 10, "Seconds the other hosts get to exit on their own "
                   "after one fails, before they are stopped.")
flags.DEFINE_bool("data_service", False,
                  "Start a local tf.data service (dispatcher + worker) for the hosts; "
                  "its address reaches them as TPU_KERAS_DATA_SERVICE.")
NETWORKS = ("private", "host")
flags.DEFINE_enum("network", "private", NETWORKS,
                  "private: the hosts, their coordinator and the --data_service run in a network "
                  "of their own that nothing outside reaches (their servers do not "
                  "authenticate); host: on this machine's network, which they need to reach "
                  "other machines (a remote tf.data service, a gs:// workdir).")

FLAGS = flags.FLAGS

GRACE_SECONDS = 5.0  # Between SIGTERM and SIGKILL: time for hosts to flush logs.
TIMEOUT_EXIT_CODE = 124  # Same convention as coreutils `timeout`.
_URL = re.compile(r"(?:^|=)([a-z][a-z0-9+.-]*://\S*)")  # gs://..., or --flag=grpc://...
_POLL_SECONDS = 0.1
_PRINT_LOCK = threading.Lock()  # One whole line at a time, from any thread.


class _Terminated(Exception):
    """Raised in the main thread when the launcher itself gets SIGTERM."""


def _log(message):
    """Prints one launcher line (stderr, so stdout holds only host output)."""
    with _PRINT_LOCK:
        sys.stdout.flush()
        print(f"[launch] {message}", file=sys.stderr, flush=True)


def _free_ports(count):
    """Returns `count` distinct free ports on 127.0.0.1.

    All sockets stay bound until every port is known, so none repeats.
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _host_env(index, workers, coordinator, devices_per_host, service_address, slices=1, tpu=""):
    """The environment one simulated host would see on a real pod."""
    env = dict(os.environ)
    for name in ("TPU_KERAS_NUM_SLICES", "TPU_KERAS_SLICE", libtpu.SIMULATED_TPU_ENV):
        env.pop(name, None)
    if tpu:
        env[libtpu.SIMULATED_TPU_ENV] = tpu
    if slices > 1:
        env.update(TPU_KERAS_NUM_SLICES=str(slices),
                   TPU_KERAS_SLICE=str(index // (len(workers) // slices)))
    if service_address:
        env["TPU_KERAS_DATA_SERVICE"] = service_address
    env.pop("TF_CONFIG", None)  # One host: no TF_CONFIG, so single-host strategy.
    env.pop("TPU_KERAS_COORDINATOR", None)
    if len(workers) > 1:
        env["TF_CONFIG"] = json.dumps({
            "cluster": {"worker": workers},
            "task": {"type": "worker", "index": index},
        })
        env["TPU_KERAS_COORDINATOR"] = coordinator  # jax.distributed, via keras.distribution
    env.update(
        TPU_KERAS_VIRTUAL_DEVICES=str(devices_per_host),
        TPU_KERAS_HOST_INDEX=str(index),
        TPU_KERAS_NUM_HOSTS=str(len(workers)),
        PYTHONUNBUFFERED="1",
    )
    return env


def _stream(pipe, prefix):
    """Copies a child's output to stdout, whole prefixed lines at a time."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            with _PRINT_LOCK:
                sys.stdout.write(f"{prefix}{line}\n")
                sys.stdout.flush()


def _exit_code(proc):
    """The child's exit code (-N if killed by signal N), or None if running.

    Does not reap the child: a zombie keeps its PID, and so its process
    group id, reserved, so signalling that group later can only reach
    processes this launcher started, never a recycled PID.
    """
    if not hasattr(os, "waitid"):  # Not Linux: fall back to reaping.
        return proc.poll()
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_group(proc, signum):
    """Signals the process group the child leads (it and its subprocesses)."""
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # Already gone.


def _stop(procs):
    """SIGTERM every host's group, then SIGKILL whatever outlives the grace."""
    for proc in procs:
        if proc.returncode is None:  # Not reaped yet, so the group id is ours.
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and any(_exit_code(p) is None for p in procs):
        time.sleep(_POLL_SECONDS)
    for proc in procs:
        if proc.returncode is None:
            _signal_group(proc, signal.SIGKILL)


def _wait(procs, deadline, timeout, failure_grace, names=None):
    """Waits for all hosts; returns 0, the first failure's code (1 for a signal), or 124.
    `names[i]` is how the log names host i ('host 3', or 'host 3 (slice 1)')."""
    names = names or [f"host {i}" for i in range(len(procs))]
    first_failure = None
    while True:
        codes = [_exit_code(p) for p in procs]
        if first_failure is None:
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                # Found together in one poll, a host killed by a signal is the cause;
                # the others exited because they lost it (a run exits at once then).
                first_failure = min(failed, key=lambda i: (codes[i] >= 0, i))
                _log(f"{names[first_failure]} failed first, with {_how(codes[first_failure])}; the "
                     f"others get {failure_grace:g} s to stop on their own")
                deadline = min(deadline, time.monotonic() + failure_grace)
                reported = {first_failure}
        if first_failure is not None:  # those found in the same poll included
            for index, code in enumerate(codes):
                if code is not None and index not in reported:
                    _log(f"{names[index]} stopped on its own, with {_how(code)}")
                    reported.add(index)
        if all(code is not None for code in codes) or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_SECONDS)
    if first_failure is not None:
        code = codes[first_failure]
        _log(f"the run failed: {names[first_failure]} failed first, with {_how(code)}")
        return code if code > 0 else 1
    if all(code == 0 for code in codes):
        return 0
    _log(f"timed out after {timeout:g} s; stopping all hosts")
    return TIMEOUT_EXIT_CODE


def _how(code):
    return f"exit code {code}" if code >= 0 else f"signal {-code} ({signal.Signals(-code).name})"


def _raise_terminated(signum, frame):
    del signum, frame
    raise _Terminated()


def _start_data_service(timeout):
    """Starts `python -m tpu_keras.data_service`; returns (process, address)."""
    proc = subprocess.Popen([sys.executable, "-m", "tpu_keras.data_service"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    ready = {}
    reader = threading.Thread(target=lambda: ready.update(line=proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    line = ready.get("line", b"").decode().split()
    if len(line) != 2 or line[0] != "ready":
        _stop([proc])
        proc.wait()
        raise UserError("the local tf.data service did not start; run "
                        "`python -m tpu_keras.data_service` to see why")
    _log(f"tf.data service at {line[1]}")
    return proc, line[1]


def _enter_private_network(command):
    """Moves this process, and so every host it starts, into a network of its own.

    A command that names another machine's URL is refused first: the hosts
    could not reach it. Where the kernel refuses the namespace, says so in one
    line and leaves the network as it is.
    """
    for arg in command:
        url = _URL.search(arg)
        if url and not url.group(1).startswith("file://"):
            raise UserError(f"the command names {url.group(1)}, which the hosts cannot reach in "
                            "the launcher's private network; pass --network=host")
    try:
        private_network.enter()
    except private_network.Unavailable as why:
        _log(f"notice: no private network here ({why}), so the hosts' TF worker, JAX coordinator "
             "and tf.data service ports listen on all interfaces, without authentication, while "
             "they run; to avoid that, allow unprivileged user namespaces (sysctl "
             "user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1) or block incoming "
             "connections with a firewall")


def simulated_pod(tpu: str) -> tuple[int, int, int]:
    """(slices, hosts per slice, devices per host) of the TPU type `tpu`."""
    slices, found = topology.parse_tpu(tpu)
    return slices, found.hosts, found.devices_per_host


def launch(command, hosts, devices_per_host, timeout=3600.0, data_service=False,
           failure_grace=10.0, network="private", slices=1, tpu=""):
    """Runs `command` once per simulated host (`hosts` per slice, `slices` slices) and
    returns the launcher's exit code.

    With `tpu` (a TPU type, its shape given by `simulated_pod`), each host's
    jax mesh is laid out in that slice's chip order (`cluster.libtpu`).

    0 if every host exits 0; the first failing host's code (or 1 if a
    signal killed it), once the others have stopped on their own within
    `failure_grace` seconds or been stopped; 124 on timeout; 128+signal if
    interrupted.
    With `network='private'` this process first moves into a private network
    namespace for good (see the module's docstring): call it from a process of
    its own, as `python -m tpu_keras.launch` does.
    Raises UserError for bad arguments.
    """
    if not command:
        raise UserError("no command given; put it after '--', e.g. "
                        "python -m tpu_keras.launch --hosts=2 -- python train.py")
    if hosts < 1:
        raise UserError(f"--hosts must be >= 1, got {hosts}")
    if slices < 1:
        raise UserError(f"--slices must be >= 1, got {slices}")
    if devices_per_host < 1:
        raise UserError(f"--devices_per_host must be >= 1, got {devices_per_host}")
    if timeout <= 0:
        raise UserError(f"--timeout must be > 0 seconds, got {timeout:g}")
    if failure_grace < 0:
        raise UserError(f"--failure_grace must be >= 0 seconds, got {failure_grace:g}")
    if network not in NETWORKS:
        raise UserError(f"--network must be one of {', '.join(NETWORKS)}, got {network!r}")
    if network == "private":
        _enter_private_network(command)

    per_slice, hosts = hosts, hosts * slices  # from here on, every host of every slice
    in_slice = [f" (slice {i // per_slice})" if slices > 1 else "" for i in range(hosts)]
    *worker_ports, coordinator_port = _free_ports(hosts + 1)
    workers = [f"127.0.0.1:{port}" for port in worker_ports]
    service, service_address = _start_data_service(min(timeout, 120)) if data_service else (None, "")
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:  # Signal handlers can only be set from the main thread.
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    procs, readers, code = [], [], 1
    start = time.monotonic()
    try:
        for index in range(hosts):
            procs.append(subprocess.Popen(
                command,
                env=_host_env(index, workers, f"127.0.0.1:{coordinator_port}", devices_per_host,
                              service_address, slices, tpu),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True))  # Own process group: stoppable as a unit.
            reader = threading.Thread(
                target=_stream, args=(procs[-1].stdout, f"[host {index}] "), daemon=True)
            reader.start()
            readers.append(reader)
        _log("hosts started: " + ", ".join(f"host {i} pid {p.pid}{in_slice[i]}"
                                           for i, p in enumerate(procs)))
        code = _wait(procs, start + timeout, timeout, failure_grace,
                     [f"host {i}{where}" for i, where in enumerate(in_slice)])
    except OSError as error:  # E.g. the command does not exist.
        _log(f"cannot start {command[0]!r}: {error.strerror or error}")
        code = 127
    except KeyboardInterrupt:
        _log("interrupted; stopping all hosts")
        code = 128 + signal.SIGINT
    except _Terminated:
        _log("got SIGTERM; stopping all hosts")
        code = 128 + signal.SIGTERM
    finally:
        try:
            if code != 0:
                _stop(procs)
            if service:
                _stop([service])
            for proc in procs + ([service] if service else []):
                proc.wait()  # Reap.
            for reader in readers:
                reader.join(timeout=GRACE_SECONDS)  # Grandchildren may hold the pipe.
        finally:
            if in_main_thread:
                signal.signal(signal.SIGTERM, previous)
    if code == 0:
        shape = f"slices={slices}, hosts={per_slice} per slice" if slices > 1 else f"hosts={hosts}"
        shape = f"{tpu}: {shape}" if tpu else shape
        _log(f"all hosts succeeded ({shape}, devices_per_host={devices_per_host}) "
             f"in {time.monotonic() - start:.1f} s")
    return code


def main(argv):
    """Everything after '--' is the command; a UserError is one `error:` line (`cli`)."""
    hosts, devices_per_host, slices = FLAGS.hosts, FLAGS.devices_per_host, FLAGS.slices
    if FLAGS.tpu:
        given = [f"--{name}" for name in ("hosts", "slices", "devices_per_host")
                 if FLAGS[name].present]
        if given:
            raise UserError(f"--tpu={FLAGS.tpu} sets the hosts, slices and devices per host; "
                            f"leave out {', '.join(given)}")
        slices, hosts, devices_per_host = simulated_pod(FLAGS.tpu)
        _log(f"simulating {FLAGS.tpu}: {slices * hosts} host(s) of {devices_per_host} device(s)"
             + (f" in {slices} slices" if slices > 1 else "") + ", the jax mesh in its chip order")
    return launch(argv[1:], hosts, devices_per_host, FLAGS.timeout, FLAGS.data_service,
                  FLAGS.failure_grace, FLAGS.network, slices, FLAGS.tpu)


if __name__ == "__main__":
    cli.start(main)
