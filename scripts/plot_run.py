"""Loss, throughput and MFU curves of a run, from its TensorBoard events, as one PNG.

    python scripts/plot_run.py /tmp/lm                 # writes /tmp/lm/run.png
    python scripts/plot_run.py /tmp/lm --out=lm.png

DIR is a run's workdir (or any folder holding event files). The panels are
the scalars `tpu_keras.train` logs at each interval: every loss (training
and validation), the gradient norm, examples/s, and MFU - each panel only when the run has it.
Needs matplotlib (`pip install -e ".[plot]"`).
"""

import io
import os
import sys

from absl import app, flags
import tensorflow as tf

_OUT = flags.DEFINE_string("out", "", "PNG to write (default: DIR/run.png).")

PANELS = (  # (title, y label, does a tag belong here)
    ("loss", "loss", lambda tag: tag == "loss" or tag.endswith("_loss")),
    ("gradient norm", "global L2 norm", lambda tag: tag == "grad_norm"),
    ("throughput", "examples/s", lambda tag: tag == "examples_per_second"),
    ("model FLOPs utilization", "MFU", lambda tag: tag == "mfu"),
)


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under `run_dir`: tag -> [(step, value)], by step."""
    from tensorboard.backend.event_processing import event_accumulator

    files = [os.path.join(root, f) for root, _, names in tf.io.gfile.walk(run_dir)
             for f in names if f.startswith("events.out.tfevents.")]  # gs:// too
    series = {}
    for folder in sorted({os.path.dirname(f) for f in files}):
        events = event_accumulator.EventAccumulator(folder, size_guidance={"tensors": 0, "scalars": 0})
        events.Reload()
        for tag in events.Tags()["tensors"]:  # TF2 summaries store scalars as tensors
            series[tag] = sorted((e.step, float(e.tensor_proto.float_val[0] if e.tensor_proto.float_val
                                               else _tensor_value(e.tensor_proto))) for e in events.Tensors(tag))
        for tag in events.Tags()["scalars"]:
            series[tag] = sorted((e.step, e.value) for e in events.Scalars(tag))
    return series


def _tensor_value(proto) -> float:
    return float(tf.make_ndarray(proto))


def plot(series: dict, title: str, out: str) -> list[str]:
    """Draws the panels that have data; returns the tags drawn."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on a TPU VM
    import matplotlib.pyplot as plt

    panels = [(name, label, [t for t in sorted(series) if belongs(t)]) for name, label, belongs in PANELS]
    panels = [p for p in panels if p[2]]
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, label, tags) in zip(axes[:, 0], panels):
        for tag in tags:
            steps, values = zip(*series[tag])
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, label=tag)
        ax.set_title(name)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(title)
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=100)
    with tf.io.gfile.GFile(out, "wb") as f:  # gs:// too
        f.write(image.getvalue())
    return [tag for _, _, tags in panels for tag in tags]


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("give one run directory: scripts/plot_run.py DIR [--out=FILE.png]")
    run_dir = argv[1]
    series = read_scalars(run_dir)
    if not any(belongs(tag) for tag in series for _, _, belongs in PANELS):
        print(f"error: no loss, throughput or MFU scalars in TensorBoard events under {run_dir}; "
              "give the --workdir of a tpu_keras.train run", file=sys.stderr)
        sys.exit(2)
    out = _OUT.value or os.path.join(run_dir, "run.png")
    drawn = plot(series, os.path.basename(os.path.abspath(run_dir)), out)
    print(f"wrote {out}: {', '.join(drawn)}")


if __name__ == "__main__":
    app.run(main)
