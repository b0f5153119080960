"""connect() on this machine, and the TPU layer at its boundary."""

import sys
import threading

import pytest

from conftest import run


def test_auto_on_a_plain_cpu_is_one_device():
    code = ("import tpu_keras; c = tpu_keras.connect({'strategy': 'auto'}); "
            "print(c.kind, c.num_hosts, c.host_index, c.num_replicas, c.replicas_per_host, c.device_kind)")
    assert run([sys.executable, "-c", code]).stdout.strip().endswith("one_device 1 0 1 1 1 x CPU")


def test_virtual_devices_give_a_mirrored_replica_each():
    code = ("import tpu_keras; c = tpu_keras.connect({'virtual_devices': 3}); "
            "print(c.kind, c.num_replicas, c.strategy.num_replicas_in_sync)")
    assert run([sys.executable, "-c", code]).stdout.strip().endswith("mirrored 3 3")


def test_unknown_strategy_is_a_user_error():
    from tpu_keras import cluster
    from tpu_keras.errors import UserError
    with pytest.raises(UserError, match="not one of"):
        cluster.connect({"strategy": "mirorred"})


def test_tpu_detection_needs_a_name_or_device_files(monkeypatch):
    from tpu_keras import tpu
    monkeypatch.delenv("TPU_NAME", raising=False)
    assert not tpu.is_present("")
    assert tpu.is_present("my-tpu")
    monkeypatch.setenv("TPU_NAME", "pod-1")
    assert tpu.is_present("")


class UnreachableResolver:
    """Stands in for TPUClusterResolver when the TPU's endpoint cannot be resolved."""

    def __init__(self, tpu, zone, project):
        raise ValueError(f"Could not lookup TPU {tpu} in zone {zone}")


def test_unreachable_tpu_is_one_line_that_says_what_to_check():
    from tpu_keras import tpu
    from tpu_keras.errors import UserError
    with pytest.raises(UserError) as error:
        tpu.initialize("my-tpu", "us-central2-b", "proj", resolver_cls=UnreachableResolver)
    message = str(error.value)
    assert "\n" not in message
    assert "cluster.tpu='my-tpu'" in message and "Could not lookup TPU my-tpu" in message


class HangingResolver:
    """Stands in for TPUClusterResolver when the metadata server or TPU API never answers."""

    def __init__(self, tpu, zone, project):
        threading.Event().wait(60)


def test_a_tpu_lookup_that_hangs_ends_in_one_line():
    from tpu_keras import tpu
    from tpu_keras.errors import UserError
    with pytest.raises(UserError, match=r"cluster.tpu='my-tpu' \(looking it up got no answer "
                                         r"within 0.2 s\)"):
        tpu.initialize("my-tpu", resolver_cls=HangingResolver, lookup_timeout_s=0.2)
