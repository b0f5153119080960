"""A LoRA run's frozen base: read again from `model.preset`, never written into a checkpoint.

A LoRA run over a preset trains its adapters alone, and the base they adapt
is frozen and already on disk at `model.preset`. So, as PEFT and TRL do, its
checkpoints hold only what trains (`training.checkpoint`: the LoRA factors,
the random-number state, the optimizer's variables), and every later start
(a resume, `evaluate`, `export`, `generate`) builds the model from
`model.preset` again, with its weights, then restores the adapters into it.
For an 8B Llama 3 at rank 16 on q_proj and v_proj, a checkpoint is then
82 MB (the factors and Adam's two moments) instead of 16 GB more (the base, in
bfloat16).

That is right only while the base is the one the adapters were trained on.
So the chief records it in `DIR/base.json` before the run's first
checkpoint: the preset's path as given, the names of its weight files and
their `fingerprint`. Every later start compares the base at `model.preset`
with that record before the model is built, and stops with one line if it
differs, having written nothing. A start with no checkpoint yet records
the base it reads afresh.

Which runs: `model.lora_rank > 0` over a preset that holds weights (not a
run's kept model, `DIR/model`, which holds none). A full fine-tune and a
LoRA over a randomly initialised base checkpoint every weight. So does a
run over a preset outside its workdir that checkpointed before records
existed: it goes on building from its kept model and its checkpoints. One
over a preset inside its workdir reads its base from there and records it;
its older checkpoints, holding the base too, still restore.
"""

# Imported inside functions: TensorFlow (start-up time: not every caller needs it); keras-hub
# (optional: absent on a plain install).
import concurrent.futures
import hashlib
import json
import os

from tpu_keras import workdir as workdir_lib
from tpu_keras.errors import UserError, first_line
from tpu_keras.models import hub_presets

RECORD = "base.json"
# A preset's files of weights: what the run's kept copy leaves out (`preset_copy`), and what
# the fingerprint reads.
WEIGHT_ENDINGS = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".h5",
                  ".pt", ".pth", ".msgpack", ".ckpt", ".gguf", ".npz")
HEAD_BYTES = 1 << 20   # a safetensors file's header (every tensor's name, dtype, shape, offsets)
BLOCK_BYTES = 64 << 10
BLOCKS = 32            # spread over the whole base, at least one in each file past its head


def path(workdir: str) -> str:
    return os.path.join(workdir, RECORD)


def adapters_only(model_config) -> bool:
    """Whether the run's checkpoints hold what trains alone: LoRA over a preset that gives
    the model its weights (`model_config` resolved: `preset_copy.use` gives a run's kept
    model, weightless, to a run that checkpointed every weight before records existed)."""
    preset = model_config.get("preset", "")
    return bool(model_config.get("lora_rank", 0)) and bool(preset) and not hub_presets.is_kept(preset)


def read(workdir: str):
    """The run's record of its base ({"preset", "files", "fingerprint", ...}), or None."""
    import tensorflow as tf
    if not tf.io.gfile.exists(path(workdir)):
        return None
    with tf.io.gfile.GFile(path(workdir)) as file:
        return json.load(file)


def record(model_config, workdir: str, checkpointed: bool) -> None:
    """The chief's record of the run's base (resolved `model_config`), made once the model is
    built (a handle's files are downloaded by then) at a start with no checkpoint yet, or
    with checkpoints and no record (a run from before); where the checkpoints hold every
    weight, a record left by an earlier start is removed instead."""
    import tensorflow as tf
    if checkpointed and read(workdir) is not None:
        return
    if not adapters_only(model_config):
        if tf.io.gfile.exists(path(workdir)):
            tf.io.gfile.remove(path(workdir))
        return
    preset = model_config.preset
    files = weight_files(preset)
    workdir_lib.write_whole(path(workdir), json.dumps({
        "checkpoints": "the LoRA adapters, the random-number state and the optimizer alone",
        "preset": preset, "files": sorted(files), "fingerprint": fingerprint(files)}, indent=2) + "\n")


def preset_of(preset: str, recorded: dict) -> str:
    """The preset to build from: `preset` as given, or the recorded one where it names none
    or a kept model (DIR/model, a config.json written before records existed)."""
    return preset if preset and not hub_presets.is_kept(preset) else recorded["preset"]


def check(preset: str, recorded: dict, workdir: str) -> None:
    """A one-line error unless the weights at `preset` are those the run's record (`recorded`,
    `read`) fingerprinted."""
    import tensorflow as tf
    try:
        files = weight_files(preset, recorded["files"])
        now = fingerprint(files)
    except (OSError, ValueError, tf.errors.OpError) as error:  # gone, unreadable, not downloadable
        files, now = {}, f"unreadable: {first_line(error, 120)}"
    if now == recorded["fingerprint"]:
        return
    where = path(workdir)
    if not files:
        how = f"it holds none of the weight files {where} records"
        how += f" ({now})" if now.startswith("unreadable") else ""
    elif sorted(files) != recorded["files"]:
        how = f"its weight files are {sorted(files)[:4]}, not {recorded['files'][:4]} as {where} records"
    else:
        how = (f"its weight files' contents differ: fingerprint {now[:19]}, {recorded['fingerprint'][:19]} "
               f"in {where}")
    raise UserError(f"model.preset={preset!r} is not the base this run's checkpoints were trained on "
                    f"({how}); its checkpoints hold the LoRA adapters alone, so put the original "
                    "base back at model.preset, or start the new base in another --workdir")


def weight_files(preset: str, names=()) -> dict:
    """{name relative to the preset: path to read} of the preset's weight files: those its
    folder holds; for a handle, those keras-hub downloaded (`names` fetched first)."""
    import tensorflow as tf
    folder = preset
    if hub_presets.is_handle(preset):
        from keras_hub.src.utils.preset_utils import CONFIG_FILE, get_file
        for name in names:
            get_file(preset, name)
        folder = os.path.dirname(get_file(preset, CONFIG_FILE))
    found = {}
    for directory, _, files in tf.io.gfile.walk(folder):
        for name in files:
            if name.endswith(WEIGHT_ENDINGS):
                full = os.path.join(directory, name)
                found[os.path.relpath(full, folder).replace(os.sep, "/")] = full
    return found


def fingerprint(files: dict) -> str:
    """'sha256:...' over the weight files `files` (`weight_files`): each one's relative name
    and size, its first MiB and 64 KiB blocks evenly spaced through it, `BLOCKS` over the
    whole base (one at least in each file past its first MiB). Read with tf.io.gfile, the
    same bytes on every host and machine, local or on gs://, in parallel: two reads per
    file and 32 more. On gs:// TensorFlow reads 64 MiB ahead at each: some 6 GB of a
    140 GB base in 30 files, a few seconds, against the 140 GB the build reads.

    It tells another checkpoint from the recorded one (another fine-tune or size, a
    re-save in another dtype, a shard replaced or added, a file cut short): those differ in
    their sizes, headers or nearly every block. It may miss a few bytes edited in place
    between the blocks it reads."""
    import tensorflow as tf
    sizes = {name: tf.io.gfile.stat(files[name]).length for name in sorted(files)}
    total = sum(sizes.values()) or 1
    reads = []
    for name, size in sizes.items():
        reads.append((name, 0, min(size, HEAD_BYTES)))
        if size > HEAD_BYTES:
            count = max(1, round(BLOCKS * size / total))
            reads += [(name, (size - BLOCK_BYTES) * (2 * i + 1) // (2 * count), BLOCK_BYTES)
                      for i in range(count)]

    def read_block(item):
        name, offset, length = item
        with tf.io.gfile.GFile(files[name], "rb") as file:
            file.seek(offset)
            return file.read(length)

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        chunks = list(pool.map(read_block, reads))
    digest = hashlib.sha256()
    for name, size in sizes.items():
        digest.update(f"{name}\0{size}\0".encode())
        for (of, offset, _), chunk in zip(reads, chunks):
            if of == name:
                digest.update(f"{offset}\0".encode() + chunk)
    return "sha256:" + digest.hexdigest()
