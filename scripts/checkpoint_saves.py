"""How long a save blocks the training loop, written synchronously and in the background.

    python scripts/checkpoint_saves.py ENGINE [MILLIONS_OF_PARAMETERS]

Run by `python scripts/benchmark.py --checkpoint`, once per engine, each in
a process of its own (the engine is chosen before Keras loads). A stack of
4096 x 4096 Dense layers (300 million parameters by default) with Adam, so a
checkpoint holds three times the weights; the toolkit's own checkpointers
(`training.checkpoint`) save it into a fresh folder on local disk, in turns:

- `synchronous` (`checkpoint.asynchronous=False`): the save returns once the
  checkpoint is written and committed;
- `asynchronous`: the save returns once the state is in host memory; the
  write goes on while the loop trains.

Between saves the loop trains a few steps, timed, so the JSON also says what
a write in the background costs the steps beside it on this machine's cores.
Prints one JSON object.
"""

from tpu_keras import lean_imports

lean_imports.install()

import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

from tpu_keras.cluster import engine as engine_lib  # noqa: E402

ENGINE = sys.argv[1]
MILLIONS = int(sys.argv[2]) if len(sys.argv) > 2 else 300
ROUNDS, STEPS_BETWEEN = 3, 4
engine_lib.select(ENGINE)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tpu_keras.training import checkpoint  # noqa: E402

WIDTH = 4096


def build():
    layers = max(1, round(MILLIONS * 1e6 / WIDTH ** 2))
    model = keras.Sequential([keras.Input((WIDTH,))]
                             + [keras.layers.Dense(WIDTH, use_bias=False) for _ in range(layers)])
    model.compile(optimizer=keras.optimizers.Adam(1e-6), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def main():
    model = build()
    batch = np.random.default_rng(0).standard_normal((8, WIDTH)).astype("float32")
    model.train_on_batch(batch, batch)  # compiled before anything is timed
    host = types.SimpleNamespace(is_chief=True, host_index=0)
    folders = {name: tempfile.mkdtemp(prefix=f"checkpoint_saves_{name}_")
               for name in ("synchronous", "asynchronous")}
    checkpointers = {name: checkpoint.open_checkpointer(folder, model, host, keep=1,
                                                 asynchronous=name == "asynchronous")
              for name, folder in folders.items()}
    blocked = {name: [] for name in checkpointers}
    steps = {name: [] for name in checkpointers}  # seconds per step right after each kind of save
    written = []  # seconds each asynchronous write took in the background
    for _ in range(ROUNDS):
        for name, checkpointer in checkpointers.items():
            before = checkpointer.writer.background_seconds if checkpointer.writer else 0.0
            began = time.perf_counter()
            checkpointer.save()
            blocked[name].append(time.perf_counter() - began)
            began = time.perf_counter()
            for _ in range(STEPS_BETWEEN):
                model.train_on_batch(batch, batch)
            steps[name].append((time.perf_counter() - began) / STEPS_BETWEEN)
            if checkpointer.writer:
                checkpointer.wait()  # the next round starts with nothing in flight
                written.append(checkpointer.writer.background_seconds - before)
    parameters = model.count_params()
    sync, async_ = (statistics.median(blocked[n]) for n in ("synchronous", "asynchronous"))
    print(json.dumps({
        "engine": ENGINE, "parameters": parameters,
        "checkpoint_bytes": 3 * 4 * parameters,  # weights and Adam's two moments, float32
        "rounds": ROUNDS,
        "blocked_seconds_per_save": {"synchronous": round(sync, 3), "asynchronous": round(async_, 3),
                                     "every_round": {n: [round(s, 3) for s in v] for n, v in blocked.items()}},
        "asynchronous_over_synchronous": round(async_ / sync, 3),
        "background_write_seconds": round(statistics.median(written), 3),
        "seconds_per_step_after_the_save": {n: round(statistics.median(v), 3) for n, v in steps.items()},
    }))


if __name__ == "__main__":
    main()
