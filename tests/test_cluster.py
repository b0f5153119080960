"""connect() on this machine (the TPU layer: test_tpu_boundary.py)."""

import json
import sys

import pytest

from conftest import run_command


def test_auto_on_a_plain_cpu_is_one_device():
    code = ("import tpu_keras; c = tpu_keras.connect({'strategy': 'auto'}); "
            "print(c.kind, c.num_hosts, c.host_index, c.num_replicas, c.replicas_per_host, c.device_kind)")
    assert run_command([sys.executable, "-c", code]).stdout.strip().endswith("one_device 1 0 1 1 1 x CPU")


@pytest.mark.slow
def test_virtual_devices_give_a_mirrored_replica_each():
    code = ("import tpu_keras; c = tpu_keras.connect({'virtual_devices': 3}); "
            "print(c.kind, c.num_replicas, c.strategy.num_replicas_in_sync)")
    assert run_command([sys.executable, "-c", code]).stdout.strip().endswith("mirrored 3 3")


def test_unknown_strategy_is_a_user_error():
    from tpu_keras import cluster
    from tpu_keras.errors import UserError
    with pytest.raises(UserError, match="not one of"):
        cluster.connect({"strategy": "mirorred"})


def _info_lines(output):
    """{host index: info dict} from `tpu_keras.info --json` lines, prefixed or not."""
    found = {}
    for line in output.splitlines():
        body = line.split("] ", 1)[1] if line.startswith("[host ") else line
        if body.startswith("{"):
            info = json.loads(body)
            found[info["host_index"]] = info
    return found


def test_info_on_a_plain_cpu_shows_the_one_device_fallback():
    info = _info_lines(run_command([sys.executable, "-m", "tpu_keras.info", "--json"],
                                   merge_stderr=False).stdout)[0]
    assert (info["strategy"], info["hosts"], info["replicas"], info["devices"]) == ("one_device", 1, 1, 1)
    assert info["tpu"] is None and info["precision"] == "float32"
    assert info["peak_flops"] > 0 and "measured matmul ceiling" in info["peak_flops_source"]


def test_info_under_the_launcher_sees_two_hosts_and_four_replicas():
    result = run_command([sys.executable, "-m", "tpu_keras.launch", "--hosts=2", "--devices_per_host=2",
                  "--timeout=200", "--", sys.executable, "-m", "tpu_keras.info", "--json"],
                         timeout=260, merge_stderr=False)
    hosts = _info_lines(result.stdout)
    assert sorted(hosts) == [0, 1], result.stdout[-2000:]
    for index, info in hosts.items():
        assert (info["strategy"], info["hosts"], info["host_index"]) == ("multi_worker", 2, index)
        assert (info["replicas"], info["replicas_per_host"], info["input_pipelines"]) == (4, 2, 2)
