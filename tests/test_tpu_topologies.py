"""Pod code against real TPU topologies: libtpu's descriptions of every slice of 1 to 64
hosts, read on this machine (no TPU, no network).

On a TPU, JAX lays a mesh out along the chip torus, which gives a host rows
of the batch far apart; CPU devices sorted by host never show that. The
matrix lays every mesh `plan --auto` can recommend on every such slice and
feeds one global batch as the hosts would; `info --tpu` prints the layout;
and reading the descriptions sends nothing off the machine.
"""

import json
import sys

import pytest

from conftest import assert_one_line_error, run_command, run_in_one_process


@pytest.fixture(scope="module")
def matrix():
    output = run_command([sys.executable, "tests/helpers/topology_matrix.py"], timeout=600, merge_stderr=False).stdout
    return {row["tpu"]: row for row in (json.loads(line[len("MATRIX "):])
                                        for line in output.splitlines() if line.startswith("MATRIX "))}


@pytest.mark.slow
def test_every_mesh_starts_on_every_slice_and_each_example_is_fed_once(matrix):
    failures = {tpu: row["failures"] for tpu, row in matrix.items() if row["failures"]}
    assert not failures, failures
    # v4, v5p: 1 to 64 hosts (v4-8 ... v4-512); v5e, v6e: every size; each as 1, 2 and 4 slices.
    for tpu in ("v4-8", "v4-24", "v4-96", "v4-512", "v5p-512", "v5litepod-1", "v5litepod-256",
                "v6e-256", "2xv4-16", "4xv5litepod-16", "4xv5p-512"):
        assert tpu in matrix, sorted(matrix)
    assert matrix["4xv5p-512"]["hosts"] == 256 and matrix["4xv5p-512"]["devices"] == 1024
    assert sum(row["meshes"] for row in matrix.values()) >= 2500
    # The meshes the toolkit refused before it followed the TPU's chip order are in it: on a
    # v5litepod-16, data=16 (the default), fsdp=16 and data=4 x fsdp=4, among others.
    assert matrix["v5litepod-16"]["meshes"] == 15 and matrix["v5litepod-16"]["interleaved"] >= 3
    assert all(matrix[t]["interleaved"] > 0 for t in ("v6e-16", "v5p-32", "v4-16", "2xv5litepod-16"))


@pytest.fixture(scope="module")
def info_calls():
    lm = ["--config=configs/lm_stdlib.py", "--engine=jax"]
    return run_in_one_process("tpu_keras.info", {
        "default": ["--tpu=v5litepod-16", "--engine=jax", "--json"],
        "model": ["--tpu=v5litepod-16", *lm, "--config.mesh.model=2"],
        "multislice": ["--tpu=2xv4-16", *lm, "--config.mesh.fsdp=2", "--json"],
        "tf": ["--tpu=v5litepod-16"],
        "unknown-type": ["--tpu=v9-16"],
        "no-such-size": ["--tpu=v4-72"],
        "mesh-does-not-fit": ["--tpu=v5litepod-16", *lm, "--config.mesh.model=3"],
        "slices-disagree": ["--tpu=2xv4-16", *lm, "--config.mesh.slices=4"],
    })


def test_info_shows_each_hosts_rows_of_the_batch_as_the_slice_lays_them_out(info_calls):
    layout = json.loads(info_calls["default"].stdout)
    assert layout["topology"] == "v5e:4x4" and layout["mesh"]["data"] == 16
    assert [h["batch_rows"] for h in layout["by_host"]] == [[0, 1, 6, 15], [2, 3, 4, 5],
                                                           [7, 12, 13, 14], [8, 9, 10, 11]]
    assert [h["input_pipeline"] for h in layout["by_host"]] == [[4, i] for i in range(4)]
    assert layout["by_host"][0]["chips"] == [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]
    table = info_calls["model"].stdout
    assert "mesh        data=8 x model=2 (jax engine)" in table, table
    assert "ring hops   data 2.00, model 1.00" in table, table  # the model axis on neighbours
    sliced = json.loads(info_calls["multislice"].stdout)
    assert sliced["hosts"] == 4 and sliced["mesh"] == {"slices": 2, "data": 4, "fsdp": 2, "expert": 1, "context": 1, "model": 1}
    rows = [set(h["batch_rows"]) for h in sliced["by_host"]]
    assert rows[0] | rows[1] == set(range(8)) and rows[2] | rows[3] == set(range(8, 16))
    assert "replicas 4-7" in info_calls["tf"].stdout  # TPUStrategy: host by host


@pytest.mark.parametrize("call, fragments", [
    ("unknown-type", ["unknown TPU slice 'v9-16'"]),
    ("no-such-size", ["TPU slice 'v4-72' does not exist", "v4-64, v4-96"]),
    ("mesh-does-not-fit", ["does not fit 16 devices", "use mesh.model=2 or 4"]),
    ("slices-disagree", ["mesh.slices=4 but --tpu=2xv4-16 is 2 slice(s)"]),
])
def test_info_refuses_bad_input_in_one_line(info_calls, call, fragments):
    result = info_calls[call]
    assert result.returncode == 2
    assert_one_line_error(result, *fragments)


NO_ROUTE_COUNTERS = """
def no_route():  # attempts to reach an address outside this namespace, IPv4 and IPv6
    ip = [line.split() for line in open("/proc/net/snmp") if line.startswith("Ip:")]
    ip6 = [line.split() for line in open("/proc/net/snmp6") if line.startswith("Ip6OutNoRoutes")]
    return int(dict(zip(*ip))["OutNoRoutes"]) + int(ip6[0][1])
"""

OFFLINE_SCRIPT = NO_ROUTE_COUNTERS + """
import os, socket, subprocess, sys
from tpu_keras.cluster import private_network
try:
    private_network.enter()  # loopback only: any other address has no route, and is counted
except private_network.Unavailable as why:
    sys.exit(print("UNAVAILABLE", why))
before = no_route()
try:
    socket.create_connection(("169.254.169.254", 80), timeout=5)  # the metadata server's address
except OSError:
    pass
control = no_route() - before
env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_") and k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
for command in (["-m", "tpu_keras.info", "--tpu=2xv5litepod-16", "--engine=jax", "--json"],
                ["tests/helpers/topology_matrix.py", "v4-32", "v6e-16"]):
    subprocess.run([sys.executable, *command], env=env, check=True, timeout=300,
                   stdout=subprocess.DEVNULL)
print("NO_ROUTE", control, no_route() - before - control)
"""


def test_reading_tpu_topologies_sends_nothing_off_the_machine():
    """In a network namespace with loopback alone, the kernel counts every attempt to reach
    another address (a connection, a datagram, a DNS query). One deliberate connection to
    the metadata server's address counts; reading libtpu's descriptions adds none."""
    result = run_command([sys.executable, "-c", OFFLINE_SCRIPT], timeout=400)
    if "UNAVAILABLE" in result.stdout:
        pytest.skip(f"no unprivileged network namespaces on this machine: {result.stdout[-300:]}")
    control, reading = map(int, result.stdout.split("NO_ROUTE ")[1].split()[:2])
    assert control == 1, result.stdout[-2000:]
    assert reading == 0, result.stdout[-2000:]
