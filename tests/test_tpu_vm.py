"""scripts/tpu_vm.sh: the exact gcloud commands it runs, recorded by a fake gcloud.

Each case runs twice: with --dry-run (stdout holds the command lines and gcloud
is never called) and for real, against a fake `gcloud` first on PATH that
appends its arguments, as one JSON list per line, to $FAKE_GCLOUD_LOG. In a dry
run the fake is told it must not be called, and fails loudly if it is.
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO

ZONE = "us-central2-b"
TRAIN = ["python3", "-m", "tpu_keras.train", "--config=configs/lm_stdlib.py",
         "--workdir=gs://my-bucket/lm"]
FAKE_GCLOUD = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if os.environ.get("FAKE_GCLOUD_FORBIDDEN"):
    sys.exit("fake gcloud: called in a dry run, which must never reach the cloud")
sys.exit(int(os.environ.get("FAKE_GCLOUD_EXIT", "0")))
"""


def _checkout(*items):
    return " ".join(shlex.quote(str(REPO / item)) for item in items)


CASES = {
    "create": (
        ["create", "my-tpu", f"--zone={ZONE}", "--type=v4-32"],
        ["gcloud compute tpus tpu-vm create my-tpu --zone=us-central2-b "
         "--accelerator-type=v4-32 --version=tpu-vm-tf-2.18.0-pod-pjrt"]),
    "create_one_host_with_project": (
        ["create", "my-tpu", "--zone", ZONE, "--type", "v5litepod-8", "--project=my-project"],
        ["gcloud compute tpus tpu-vm create my-tpu --zone=us-central2-b "
         "--accelerator-type=v5litepod-8 --version=tpu-vm-tf-2.18.0-pjrt-v5e-and-v6 "
         "--project=my-project"]),
    "create_spot": (
        ["create", "my-tpu", f"--zone={ZONE}", "--type=v4-32", "--spot", "--engine=jax"],
        ["gcloud compute tpus queued-resources create my-tpu --node-id=my-tpu "
         "--zone=us-central2-b --accelerator-type=v4-32 "
         "--runtime-version=tpu-ubuntu2204-base --spot"]),
    "create_with_version": (  # --version wins over the engine's runtime
        ["create", "my-tpu", f"--zone={ZONE}", "--type=v4-32", "--engine=jax",
         "--version=tpu-vm-tf-2.17.0-pod-pjrt"],
        ["gcloud compute tpus tpu-vm create my-tpu --zone=us-central2-b "
         "--accelerator-type=v4-32 --version=tpu-vm-tf-2.17.0-pod-pjrt"]),
    "run_on_every_worker": (
        ["run", "my-tpu", f"--zone={ZONE}", "--",
         *TRAIN, "--config.engine=jax", "--config.cluster.tpu=local"],
        ["gcloud compute tpus tpu-vm ssh my-tpu --zone=us-central2-b --worker=all "
         "--command='cd tpu_keras && TPU_NAME=local python3 -m tpu_keras.train "
         "--config=configs/lm_stdlib.py --workdir=gs://my-bucket/lm "
         "--config.engine=jax --config.cluster.tpu=local'"]),
    "run_tf_pod": (
        ["run", "my-tpu", f"--zone={ZONE}", "--tf-pod", "--dir=~/code",
         "--env=TF_CPP_MIN_LOG_LEVEL=1", "--", *TRAIN],
        ["gcloud compute tpus tpu-vm ssh my-tpu --zone=us-central2-b --worker=0 "
         "--command='cd code && TPU_NAME=my-tpu TPU_LOAD_LIBRARY=0 TF_CPP_MIN_LOG_LEVEL=1 "
         "python3 -m tpu_keras.train --config=configs/lm_stdlib.py "
         "--workdir=gs://my-bucket/lm'"]),
    "copy_and_install": (
        ["copy", "my-tpu", f"--zone={ZONE}", "--install"],
        ["gcloud compute tpus tpu-vm ssh my-tpu --zone=us-central2-b --worker=all "
         "--command='mkdir -p tpu_keras'",
         "gcloud compute tpus tpu-vm scp "
         + _checkout("setup.py", "setup.cfg", "README.md", "tpu_keras", "configs", "scripts")
         + " my-tpu:tpu_keras --zone=us-central2-b --worker=all --recurse",
         "gcloud compute tpus tpu-vm ssh my-tpu --zone=us-central2-b --worker=all "
         "--command='cd tpu_keras && python3 -m pip install -e .'"]),
    "ssh": (
        ["ssh", "my-tpu", f"--zone={ZONE}", "--worker=3"],
        ["gcloud compute tpus tpu-vm ssh my-tpu --zone=us-central2-b --worker=3"]),
    "delete": (
        ["delete", "my-tpu", f"--zone={ZONE}"],
        ["gcloud compute tpus tpu-vm delete my-tpu --zone=us-central2-b --quiet"]),
    "delete_spot": (
        ["delete", "my-tpu", f"--zone={ZONE}", "--spot", "--project=my-project"],
        ["gcloud compute tpus queued-resources delete my-tpu --zone=us-central2-b "
         "--force --quiet --project=my-project"]),
    # Multislice: one queued resource of --node-count slices named --node-prefix-0, -1, ...
    "create_two_slices": (
        ["create", "my-ms", f"--zone={ZONE}", "--type=v5litepod-256", "--slices=2", "--engine=jax",
         "--reserved"],
        ["gcloud compute tpus queued-resources create my-ms --node-count=2 --node-prefix=my-ms "
         "--zone=us-central2-b --accelerator-type=v5litepod-256 "
         "--runtime-version=v2-alpha-tpuv5-lite --reserved"]),
    "copy_to_two_slices": (
        ["copy", "my-ms", f"--zone={ZONE}", "--slices=2"],
        [line for node in ("my-ms-0", "my-ms-1") for line in (
            f"gcloud compute tpus tpu-vm ssh {node} --zone=us-central2-b --worker=all "
            "--command='mkdir -p tpu_keras'",
            "gcloud compute tpus tpu-vm scp "
            + _checkout("setup.py", "setup.cfg", "README.md", "tpu_keras", "configs", "scripts")
            + f" {node}:tpu_keras --zone=us-central2-b --worker=all --recurse")]),
    "delete_two_slices": (
        ["delete", "my-ms", f"--zone={ZONE}", "--slices=2"],
        ["gcloud compute tpus queued-resources delete my-ms --zone=us-central2-b --force --quiet"]),
}


@pytest.fixture
def tpu_vm(tmp_path):
    """Runs scripts/tpu_vm.sh with the fake gcloud; returns (result, recorded argv lists)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    log = tmp_path / "gcloud.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "FAKE_GCLOUD_LOG": str(log)}

    def call(*args, shell_line=None, gcloud_exit=0, dry=False, extra_env=None):
        """dry=True: the fake gcloud fails if it is called at all."""
        argv = ["bash", "-c", shell_line] if shell_line else ["bash", "scripts/tpu_vm.sh", *args]
        run_env = {**env, "FAKE_GCLOUD_EXIT": str(gcloud_exit), **(extra_env or {})}
        if dry:
            run_env["FAKE_GCLOUD_FORBIDDEN"] = "1"
        result = subprocess.run(argv, cwd=REPO, env=run_env, capture_output=True, text=True,
                                timeout=30)
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        log.unlink(missing_ok=True)
        return result, calls

    return call


@pytest.mark.parametrize("case", CASES)
def test_dry_run_prints_the_exact_commands(tpu_vm, case):
    args, lines = CASES[case]
    result, calls = tpu_vm(args[0], "--dry-run", *args[1:], dry=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(line + "\n" for line in lines)
    assert calls == []  # nothing ran


@pytest.mark.parametrize("case", CASES)
def test_runs_the_same_commands(tpu_vm, case):
    args, lines = CASES[case]
    result, calls = tpu_vm(*args)
    assert result.returncode == 0, result.stderr
    assert calls == [shlex.split(line)[1:] for line in lines]
    assert result.stderr.splitlines() == ["+ " + line for line in lines]  # it shows what it runs


def test_dry_run_lines_run_as_printed(tpu_vm):
    """A printed line, pasted into a shell, passes gcloud the same arguments."""
    args = ["run", "my-tpu", f"--zone={ZONE}", "--", "python3", "-c", "print('hi')", "a b"]
    printed, _ = tpu_vm("--dry-run", *args)
    _, pasted = tpu_vm(shell_line=printed.stdout)
    _, ran = tpu_vm(*args)
    assert pasted == ran
    assert ran[0][-1] == ("--command=cd tpu_keras && TPU_NAME=local "
                          "python3 -c 'print('\\''hi'\\'')' 'a b'")


@pytest.mark.parametrize("args, env", [
    (["--dry-run", "delete", "my-tpu", f"--zone={ZONE}"], {}),
    (["delete", "--dry-run", "my-tpu", f"--zone={ZONE}"], {}),
    (["delete", "my-tpu", "--dry-run", f"--zone={ZONE}"], {}),
    (["delete", "my-tpu", f"--zone={ZONE}", "--dry-run"], {}),
    (["delete", "my-tpu", f"--zone={ZONE}"], {"TPU_VM_DRY_RUN": "1"}),
])
def test_dry_run_anywhere_before_double_dash_runs_nothing(tpu_vm, args, env):
    result, calls = tpu_vm(*args, dry=True, extra_env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "gcloud compute tpus tpu-vm delete my-tpu --zone=us-central2-b --quiet\n"
    assert calls == []


def test_dry_run_just_before_the_command_to_run(tpu_vm):
    result, calls = tpu_vm("run", "my-tpu", f"--zone={ZONE}", "--dry-run", "--", "ls", dry=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ("gcloud compute tpus tpu-vm ssh my-tpu --zone=us-central2-b "
                             "--worker=all --command='cd tpu_keras && TPU_NAME=local ls'\n")
    assert calls == []


@pytest.mark.parametrize("before", [[], ["--dry-run"]])
def test_dry_run_after_double_dash_is_refused(tpu_vm, before):
    """After --, --dry-run would be a word of COMMAND and gcloud would run for real."""
    result, calls = tpu_vm("run", "my-tpu", f"--zone={ZONE}", *before, "--", "./plan.sh",
                           "--dry-run", dry=True)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpu_vm.sh: error: --dry-run after -- "), lines
    assert "put it before --: tpu_vm.sh run my-tpu ... --dry-run -- ..." in lines[0]
    assert calls == []


# The runtime create picks: (type, engine) -> --version, from the script's RUNTIMES table.
RUNTIMES = {
    ("v4-8", "tf"): "tpu-vm-tf-2.18.0-pjrt",
    ("v4-32", "tf"): "tpu-vm-tf-2.18.0-pod-pjrt",
    ("v4-8", "jax"): "tpu-ubuntu2204-base",
    ("v4-32", "jax"): "tpu-ubuntu2204-base",
    ("v5litepod-8", "tf"): "tpu-vm-tf-2.18.0-pjrt-v5e-and-v6",      # 8 chips, one host
    ("v5litepod-16", "tf"): "tpu-vm-tf-2.18.0-pod-pjrt-v5e-and-v6",
    ("v5litepod-8", "jax"): "v2-alpha-tpuv5-lite",
    ("v5litepod-16", "jax"): "v2-alpha-tpuv5-lite",
    ("v5p-8", "tf"): "tpu-vm-tf-2.18.0-pjrt",
    ("v5p-16", "tf"): "tpu-vm-tf-2.18.0-pod-pjrt",                  # 8 chips, two hosts
    ("v5p-8", "jax"): "v2-alpha-tpuv5",
    ("v5p-16", "jax"): "v2-alpha-tpuv5",
    ("v6e-8", "tf"): "tpu-vm-tf-2.18.0-pjrt-v5e-and-v6",
    ("v6e-16", "tf"): "tpu-vm-tf-2.18.0-pod-pjrt-v5e-and-v6",
    ("v6e-8", "jax"): "v2-alpha-tpuv6e",
    ("v6e-16", "jax"): "v2-alpha-tpuv6e",
}


@pytest.mark.parametrize("slice_type, engine", sorted(RUNTIMES))
def test_create_picks_the_runtime_for_the_generation_hosts_and_engine(tpu_vm, slice_type, engine):
    result, calls = tpu_vm("create", "my-tpu", f"--zone={ZONE}", f"--type={slice_type}",
                           f"--engine={engine}")
    assert result.returncode == 0, result.stderr
    assert calls == [["compute", "tpus", "tpu-vm", "create", "my-tpu", f"--zone={ZONE}",
                      f"--accelerator-type={slice_type}",
                      f"--version={RUNTIMES[slice_type, engine]}"]]


def test_the_engine_defaults_to_tf(tpu_vm):
    result, calls = tpu_vm("create", "my-tpu", f"--zone={ZONE}", "--type=v6e-16")
    assert calls[0][-1] == "--version=" + RUNTIMES["v6e-16", "tf"]


def test_stops_at_a_failing_command_with_its_exit_code(tpu_vm):
    """A run preempted on the VM (exit 42) ends the script with 42; copy stops at a failure."""
    result, calls = tpu_vm("run", "my-tpu", f"--zone={ZONE}", "--", *TRAIN, gcloud_exit=42)
    assert result.returncode == 42 and len(calls) == 1
    result, calls = tpu_vm("copy", "my-tpu", f"--zone={ZONE}", "--install", gcloud_exit=1)
    assert result.returncode == 1 and len(calls) == 1


def test_run_on_two_slices_reaches_every_host_of_each_at_once(tpu_vm):
    """Each slice's workers, all of them, in one run; the first failing slice's code ends it."""
    args = ["run", "my-ms", f"--zone={ZONE}", "--slices=2", "--", *TRAIN, "--config.mesh.slices=2"]
    expected = [["compute", "tpus", "tpu-vm", "ssh", node, f"--zone={ZONE}", "--worker=all",
                 "--command=cd tpu_keras && TPU_NAME=local " + " ".join(TRAIN)
                 + " --config.mesh.slices=2"] for node in ("my-ms-0", "my-ms-1")]
    printed, calls = tpu_vm("--dry-run", *args, dry=True)
    assert calls == [] and [shlex.split(line)[1:] for line in printed.stdout.splitlines()] == expected
    result, calls = tpu_vm(*args, gcloud_exit=42)
    assert result.returncode == 42 and sorted(calls) == expected  # both started, in any order


def test_run_passes_every_word_unchanged(tpu_vm, tmp_path):
    """The VM's shell sees COMMAND's words exactly: quotes, $, spaces, empty words."""
    words = ["it's", "$HOME", "", "a  b", "*", "x;y", "--flag='q'"]
    probe = "import json, os, sys; print(json.dumps([os.environ['TPU_NAME'], *sys.argv[1:]]))"
    _, calls = tpu_vm("run", "my-tpu", f"--zone={ZONE}", "--", sys.executable, "-c", probe, *words)
    remote = calls[0][-1].removeprefix("--command=")
    vm_home = tmp_path / "vm_home"
    (vm_home / "tpu_keras").mkdir(parents=True)
    seen = subprocess.run(["bash", "-c", remote], cwd=vm_home, capture_output=True, text=True,
                          timeout=30, check=True).stdout
    assert json.loads(seen) == ["local", *words]


@pytest.mark.parametrize("args, fragment", [
    (["crate", "my-tpu", f"--zone={ZONE}"], "unknown command 'crate'; use one of create,"),
    (["create", f"--zone={ZONE}", "--type=v4-32"], "create needs the TPU's name"),
    (["run", "my-tpu", "--", "ls"], "run needs the TPU's zone: add --zone=ZONE"),
    (["create", "my-tpu", f"--zone={ZONE}"], "add --type=TYPE, e.g. --type=v4-32"),
    (["create", "my-tpu", f"--zone={ZONE}", "--type=v4"], "--type=v4 is not an accelerator type"),
    (["run", "my-tpu", f"--zone={ZONE}", "--zoen=x", "--", "ls"],
     "run does not take --zoen; it takes --zone,"),
    (["ssh", "my-tpu", f"--zone={ZONE}", "--spot"], "ssh does not take --spot"),
    (["run", "my-tpu", f"--zone={ZONE}"], "run needs the command after --"),
    (["run", "my-tpu", "--zone", "--", "ls"], "--zone needs a value: write --zone=VALUE"),
    (["run", "my-tpu", f"--zone={ZONE}", "--tf-pod", "--worker=2", "--", "ls"],
     "--tf-pod runs on worker 0; leave out --worker=2"),
    (["delete", "my-tpu", f"--zone={ZONE}", "--", "ls"], "only run takes a command after --"),
    (["create", "my-tpu", f"--zone={ZONE}", "--type=v5e-16"], "write --type=v5litepod-16"),
    (["create", "my-tpu", f"--zone={ZONE}", "--type=tpu7x-8"],
     "use v2, v3, v4, v5litepod (v5e), v5p or v6e"),
    (["create", "my-tpu", f"--zone={ZONE}", "--type=v4-8", "--engine=torch"],
     "write --engine=tf or --engine=jax"),
    (["delete", "my-tpu", f"--zone={ZONE}", "--engine=jax"], "delete does not take --engine"),
    (["create", "my-ms", f"--zone={ZONE}", "--type=v3-32", "--slices=2", "--engine=jax"],
     "Cloud TPU offers multislice on v4 and later"),
    (["create", "my-ms", f"--zone={ZONE}", "--type=v4-32", "--slices=2"], "add --engine=jax"),
    (["create", "my-ms", f"--zone={ZONE}", "--type=v4-32", "--slices=two"],
     "--slices=two is not a number of slices"),
    (["create", "my-tpu", f"--zone={ZONE}", "--type=v4-32", "--spot", "--reserved"],
     "give one of them"),
    (["run", "my-ms", f"--zone={ZONE}", "--slices=2", "--tf-pod", "--", "ls"], "leave out --tf-pod"),
])
def test_bad_usage_is_one_line_and_exit_2(tpu_vm, args, fragment):
    for extra in ([], ["--dry-run"]):
        result, calls = tpu_vm(*extra, *args, dry=True)
        assert result.returncode == 2
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("tpu_vm.sh: error: "), result.stderr
        assert fragment in lines[0]
        assert calls == []


@pytest.mark.parametrize("args", [[], ["--help"], ["run", "--help"]])
def test_help_prints_usage(tpu_vm, args):
    result, calls = tpu_vm(*args)
    assert result.returncode == 0
    assert result.stdout.startswith("Create, reach and delete Cloud TPU VMs")
    for command in ("create NAME", "delete NAME", "ssh NAME", "copy NAME", "run NAME", "--dry-run",
                    "--engine=tf|jax", "TPU7x"):
        assert command in result.stdout
    for runtime in set(RUNTIMES.values()):  # the table is shown too
        assert runtime in result.stdout
    assert calls == []


def test_bad_dry_run_variable_is_one_line(tpu_vm):
    result, calls = tpu_vm("delete", "my-tpu", f"--zone={ZONE}", dry=True,
                           extra_env={"TPU_VM_DRY_RUN": "yes"})
    assert result.returncode == 2 and calls == []
    assert result.stderr == ("tpu_vm.sh: error: TPU_VM_DRY_RUN=yes is not 0 or 1; "
                             "write TPU_VM_DRY_RUN=1 for a dry run, or unset it\n")


def _documents():
    """The README and every guide under docs/, as paths relative to the repository."""
    return ["README.md"] + sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))


def _documented_command_lines():
    """Every `scripts/tpu_vm.sh ...` line (continuations joined) in the README and the guides."""
    for doc in _documents():
        text = (REPO / doc).read_text().replace("\\\n", " ")
        for line in re.findall(r"^(scripts/tpu_vm\.sh .*)$", text, flags=re.MULTILINE):
            yield doc, line.split("  #")[0].strip()  # without a trailing comment


def test_the_docs_command_lines_are_ones_the_script_takes(tpu_vm):
    """The README and the guides use the script's own option names: each line dry-runs cleanly."""
    lines = list(_documented_command_lines())
    assert len(lines) >= 15
    for doc, line in lines:
        result, calls = tpu_vm(shell_line=line, dry=True, extra_env={"TPU_VM_DRY_RUN": "1"})
        assert result.returncode == 0 and calls == [], f"{doc}: {line}\n{result.stderr}"


def test_the_docs_name_the_runtimes_the_script_picks():
    runtime = re.compile(r"`((?:tpu-vm-tf-|v2-alpha-tpuv|tpu-ubuntu)[\w.-]*)`")
    script = (REPO / "scripts/tpu_vm.sh").read_text()
    named_anywhere = set()
    for doc in _documents():
        named = set(runtime.findall((REPO / doc).read_text()))
        assert named <= set(RUNTIMES.values()), (doc, named - set(RUNTIMES.values()))
        assert all(name in script for name in named)
        named_anywhere |= named
    assert named_anywhere  # the pod guide names them (step 4)
