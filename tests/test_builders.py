"""Tests of the offline TFDS builders: what they write, and that hosts can share a data_dir."""

import hashlib
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow_datasets as tfds

from tpu_keras.data import offline, digits, stdlib_bytes

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
ROW_LENGTH = 129  # ctx128: 128 inputs + 1 shifted target.


def _start_python(code, *args, **env_overrides):
    """Starts `code` in a fresh interpreter that imports this checkout."""
    env = dict(os.environ, **env_overrides)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO_ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _last_line(process):
    """Waits for `process` to succeed and returns the last line it printed."""
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    return stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def stdlib_builder(tmp_path_factory):
    return offline.prepare("stdlib_bytes/ctx128", str(tmp_path_factory.mktemp("tfds")))


@pytest.fixture(scope="module")
def digits_builder(tmp_path_factory):
    return offline.prepare("digits", str(tmp_path_factory.mktemp("tfds")))


@pytest.fixture(scope="module")
def train_tokens(stdlib_builder):
    return tfds.as_numpy(stdlib_builder.as_dataset(split="train", batch_size=-1))["tokens"]


# --- stdlib_bytes: which files go where -------------------------------------------------

def test_listing_leaves_out_tests_and_third_party_code():
    paths = [path for path, _ in stdlib_bytes.stdlib_files()]
    assert paths == sorted(paths) and len(paths) == len(set(paths))
    assert all(path.endswith(".py") for path in paths)
    assert not any(set(path.split("/")[:-1]) & stdlib_bytes.EXCLUDED_DIRS for path in paths)
    assert {"os.py", "json/__init__.py"} <= set(paths)
    on_disk_tests = list((stdlib_bytes.STDLIB_ROOT / "test").glob("*.py"))
    if on_disk_tests:
        assert f"test/{on_disk_tests[0].name}" not in paths


def test_split_is_disjoint_and_about_five_percent_validation():
    listing = stdlib_bytes.stdlib_files()
    train = {path for path, split in listing if split == "train"}
    validation = {path for path, split in listing if split == "validation"}
    assert train.isdisjoint(validation)
    assert len(train) + len(validation) == len(listing)
    assert 0.02 < len(validation) / len(listing) < 0.10


@pytest.mark.slow
def test_split_is_the_same_in_every_process():
    here = hashlib.sha256(repr(stdlib_bytes.stdlib_files()).encode()).hexdigest()
    assert repr(stdlib_bytes.stdlib_files()) == repr(stdlib_bytes.stdlib_files())
    elsewhere = _start_python(
        """
        import hashlib
        from tpu_keras.data.stdlib_bytes import stdlib_files
        print(hashlib.sha256(repr(stdlib_files()).encode()).hexdigest())
        """,
        PYTHONHASHSEED="12345")
    assert _last_line(elsewhere) == here


# --- stdlib_bytes: the prepared dataset -------------------------------------------------

def test_stdlib_splits_and_shards(stdlib_builder):
    splits = stdlib_builder.info.splits
    assert set(splits) == {"train", "validation"}
    assert splits["train"].num_shards >= 16
    assert splits["validation"].num_shards >= 4
    assert len(splits["train"].filenames) == splits["train"].num_shards


def test_stdlib_examples_cover_the_stream(stdlib_builder):
    for split in ("train", "validation"):
        stream = stdlib_bytes.split_stream(split)
        assert stdlib_builder.info.splits[split].num_examples == len(stream) // ROW_LENGTH
    files = [path for path, split in stdlib_bytes.stdlib_files() if split == "validation"]
    total_size = sum((stdlib_bytes.STDLIB_ROOT / path).stat().st_size for path in files)
    assert len(stdlib_bytes.split_stream("validation")) == total_size + len(files) - 1


def test_stdlib_examples_are_python_source_bytes(stdlib_builder):
    first = next(iter(tfds.as_numpy(stdlib_builder.as_dataset(split="train"))))["tokens"]
    assert first.shape == (ROW_LENGTH,) and first.dtype == np.uint8
    # Shard 0 starts with row 0, the head of the stream.
    assert first.tobytes() == stdlib_bytes.split_stream("train")[:ROW_LENGTH]
    text = first.tobytes()
    printable = sum(32 <= byte < 127 or byte in b"\n\t\r" for byte in text)
    assert printable / len(text) > 0.95


def test_stdlib_train_entropy_is_that_of_source_code(train_tokens):
    assert train_tokens.shape[1:] == (ROW_LENGTH,) and train_tokens.dtype == np.uint8
    probabilities = np.bincount(train_tokens.ravel(), minlength=256) / train_tokens.size
    probabilities = probabilities[probabilities > 0]
    bits_per_byte = float(-(probabilities * np.log2(probabilities)).sum())
    print(f"stdlib_bytes train unigram entropy: {bits_per_byte:.3f} bits/byte")
    assert 4.0 < bits_per_byte < 5.5


# --- digits ------------------------------------------------------------------------------

def test_digits_splits(digits_builder):
    splits = digits_builder.info.splits
    assert (splits["train"].num_examples, splits["test"].num_examples) == (1437, 360)
    assert splits["train"].num_shards >= 4 and splits["test"].num_shards >= 2
    assert digits_builder.info.supervised_keys == ("image", "label")


def test_digits_examples(digits_builder):
    images, labels = digits.load_digits()
    for split in ("train", "test"):
        data = tfds.as_numpy(digits_builder.as_dataset(split=split, batch_size=-1))
        assert data["image"].shape[1:] == (8, 8, 1) and data["image"].dtype == np.uint8
        assert data["image"].max() <= 16
        assert set(np.unique(data["label"])) == set(range(10))
    # Shard 0 of test starts with example 0, which i % 5 == 0 puts in test.
    first = next(iter(tfds.as_numpy(digits_builder.as_dataset(split="test"))))
    np.testing.assert_array_equal(first["image"], images[0])
    assert first["label"] == labels[0]


def test_digits_without_sklearn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(RuntimeError, match="pip install scikit-learn"):
        digits.load_digits()


# --- offline.prepare --------------------------------------------------------------------

def test_prepare_returns_other_datasets_unprepared(tmp_path):
    builder = offline.prepare("mnist", str(tmp_path))
    assert builder.name == "mnist" and not builder.is_prepared()


def test_prepare_lets_unknown_names_fail(tmp_path):
    with pytest.raises(tfds.core.registered.DatasetNotFoundError):
        offline.prepare("no_such_dataset_anywhere", str(tmp_path))


@pytest.mark.slow
def test_two_hosts_preparing_one_data_dir_at_once(tmp_path):
    """Without the lock, the slower host fails to rename its copy into place."""
    data_dir = tmp_path / "tfds"
    child = """
        import pathlib, sys, time
        from tpu_keras.data import offline
        data_dir, me, other = sys.argv[1:]
        barrier = pathlib.Path(data_dir).parent
        (barrier / me).touch()
        while not (barrier / other).exists():  # Start preparing together.
            time.sleep(0.01)
        print(offline.prepare("digits", data_dir).info.splits["train"].num_examples)
        """
    hosts = [_start_python(child, str(data_dir), me, other) for me, other in ("ab", "ba")]
    assert [_last_line(host) for host in hosts] == ["1437", "1437"]
    assert tfds.builder("digits", data_dir=str(data_dir)).is_prepared()
