"""Context parallelism (`mesh.context`): the tiny Llama's steps with its sequences split over
devices against the same steps on one device, in one process of 4 CPU devices.

    python tests/helpers/context_probe.py DATA_DIR [MESH,MESH,...]

For plain text (configs/llama_stdlib.py:tiny, byte windows of 64) and for
instruction pairs packed apart (configs/instruct_stdlib.py:tiny, 128 tokens,
each pair attending to itself alone), from the same initial weights and on
the same batches: 3 SGD steps on one device, on `fsdp=2 x context=2`, on
`context=4`, and on `context=2 x model=2` without and with
`layout.sequence_parallel` (a second argument, MESH,MESH,..., runs those alone). Prints one line, `CONTEXT {json}`: per data and mesh, the logged
losses, the largest difference of the weights from the one-device run's
after the steps, and the largest update; the attention layers whose keys and
values a trace gathered over `context`, and the all-gathers in the compiled
forward pass of each split mesh (its reduce-scatters and all-reduces too). Then the TPU's fused kernel on a split
sequence (`splash`: each device's queries against the gathered keys, in
Pallas's interpreter) against keras-hub's own attention, for a keras-hub
Llama of 256 tokens on data=2 x context=2: the largest differences of the
outputs and the gradients.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from tpu_keras.cluster import engine  # noqa: E402

engine.select("jax", 4)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras import data  # noqa: E402
from tpu_keras.models import context_attention  # noqa: E402
from tpu_keras.training import run_config  # noqa: E402
from tpu_keras.training.setup import build_model  # noqa: E402

sys.path.insert(0, "configs")
import instruct_stdlib  # noqa: E402
import llama_stdlib  # noqa: E402

data_dir = sys.argv[1]
MESHES = {"one": dict(data=1), "fsdp2_context2": dict(data=1, fsdp=2, context=2),
          "context4": dict(data=1, context=4),
          # layout.sequence_parallel: each block's output split along the sequence over
          # context x model (models.sequence_parallel); against the same mesh without it
          "context2_model2": dict(data=1, context=2, model=2),
          "context2_model2_sequence": dict(data=1, context=2, model=2)}
MESHES = {name: MESHES[name] for name in sys.argv[2].split(",")} if len(sys.argv) > 2 else MESHES
STEPS, BATCH = 3, 8


def config_of(kind, name, mesh):
    config = (llama_stdlib.get_config("tiny") if kind == "text" else instruct_stdlib.get_config("tiny"))
    config.engine = "jax"
    config.data.data_dir = data_dir
    config.mesh = dict(mesh)
    config.layout.sequence_parallel = name.endswith("_sequence")
    if name == "one":
        config.cluster.strategy = "one_device"
    config.train.update(optimizer="sgd", learning_rate=0.5, warmup_steps=0, clipnorm=0.0, weight_decay=0.0,
                        batch_size=BATCH, steps_per_execution=1, precision="float32")
    return config


def compiled_forward_gathers(model, cluster, x) -> int:
    """All-gathers in the compiled forward pass of `model` on the batch `x` laid out as the
    trainer lays it."""
    layout = keras.distribution.distribution().get_data_layout(x.shape).backend_layout
    inputs = jax.device_put(x, layout)
    values = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])
    text = jax.jit(model.stateless_call).lower(*values, inputs).compile().as_text()
    return {"all_gathers": text.count(" all-gather(") + text.count(" all-gather-start("),
            "reduce_scatters": text.count(" reduce-scatter(") + text.count(" reduce-scatter-start("),
            "all_reduces": text.count(" all-reduce(") + text.count(" all-reduce-start(")}


result = {}
for kind in ("text", "instructions"):
    initial, runs = None, {}
    for name, mesh in MESHES.items():
        config = config_of(kind, name, mesh)
        cluster = tpu_keras.connect(config.cluster, engine="jax", mesh=config.mesh)
        # As a run resolves it: the tokens per row and the end token of packed pairs.
        config = run_config.resolve(config, cluster, tempfile.mkdtemp(), checkpointed=False)
        keras.utils.set_random_seed(0)
        model = build_model(config, cluster)
        initial = initial or model.get_weights()
        model.set_weights(initial)
        batches, _ = data.build(config.data, cluster, BATCH, training=True)
        history = model.fit(batches, steps_per_epoch=1, epochs=STEPS, verbose=0)
        runs[name] = {"losses": [float(x) for x in history.history["loss"]], "weights": model.get_weights()}
        if name != "one":
            x = next(iter(data.build(config.data, cluster, BATCH, training=True)[0]))[0]
            runs[name].update(compiled_forward_gathers(model, cluster, np.asarray(x)))
        keras.backend.clear_session()
    gap = lambda a, b: max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
    result[kind] = {name: {"losses": run["losses"], "from_one_device": gap(run["weights"], runs["one"]["weights"]),
                           **{key: run[key] for key in ("all_gathers", "reduce_scatters", "all_reduces")
                              if key in run}}
                    for name, run in runs.items()}
    result[kind]["update"] = gap(runs["one"]["weights"], initial)
result["gathered_layers"] = context_attention.gathered_layers()


def splash_on_a_split_sequence() -> dict:
    import keras_hub
    from tpu_keras.models import splash_attention
    from tpu_keras.parallelism import mesh as mesh_lib
    sizes = {"data": 2, "fsdp": 1, "expert": 1, "context": 2, "model": 1}
    device_mesh = keras.distribution.DeviceMesh(tuple(sizes[a] for a in mesh_lib.AXES), mesh_lib.AXES,
                                                jax.devices()[:4])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(device_mesh), batch_dim_name="data"))
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=64, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=2, hidden_dim=64, intermediate_dim=128)
    rng = np.random.default_rng(0)
    inputs = {"token_ids": rng.integers(0, 64, (4, 256)).astype("int32"),
              "padding_mask": np.ones((4, 256), "int32")}
    direction = rng.standard_normal((4, 256, 64)).astype("float32")
    weights = [v.value for v in backbone.trainable_variables]

    def outputs_and_gradients():
        def loss(w):
            out = backbone.stateless_call(w, [], inputs)[0]
            return (out.astype("float32") * direction).sum(), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(weights)
        return np.asarray(out), [np.asarray(g) for g in grads]

    keras_out, keras_grads = outputs_and_gradients()
    routed = splash_attention.route_layers(backbone, interpret=True, shortest=256)
    splash_out, splash_grads = outputs_and_gradients()
    return {"routed": routed, "outputs": float(np.abs(splash_out - keras_out).max()),
            "scale": float(np.abs(keras_out).max()),
            "gradients": max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))
                             for a, b in zip(splash_grads, keras_grads))}


if len(sys.argv) <= 2:
    result["splash"] = splash_on_a_split_sequence()
print("CONTEXT " + json.dumps(result), flush=True)
