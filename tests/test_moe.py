"""Mixtures of experts: the sparse layer (tpu_keras/models/moe.py) against keras-hub's dense bank,
transformers' load-balancing loss and the TPU compiler's cost analysis (tests/helpers/moe_probe.py);
the MoE families from checkpoints transformers 5's save_pretrained writes (8 experts, top 2:
tests/helpers/hf_pretrained.py), on one device against transformers (tests/helpers/hf_probe.py;
on expert meshes: tests/test_moe_families_on_expert_meshes.py); and their bad inputs, one
line each."""

import json
import re
import sys

import pytest

from conftest import assert_one_line_error, run_command, run_in_one_process, train, train_args
from hf_checks import TOLERANCE, TRANSFORMERS, assert_refused, probe
import hf_pretrained

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe_text", "gemma4_moe")
WITHOUT_BALANCING_LOSS = ("gemma4_moe",)  # transformers computes none for Gemma 4
ROUTER = re.compile(r"sparse_feedforward_gate_dense|router_dense|router_gate|moe_router")  # each family's
EXPERTS = re.compile(r"experts/|expert_bank/")  # each family's expert weights (Gemma 4's `moe_expert_bank`)


def relative(result, name, gap: float) -> float:
    return gap / result[name]["scale"]


@pytest.mark.slow
def test_sparse_layer_is_keras_hubs_bank_at_top_k_over_e_of_its_flops():
    result = run_command([sys.executable, "tests/helpers/moe_probe.py"], timeout=600)
    found = json.loads(next(line[4:] for line in result.stdout.splitlines() if line.startswith("MOE ")))
    assert found["tiled"] < 1e-4, found["tiled"]  # the CPU's tiles are ragged_dot's products
    for name, checks in found["blocks"].items():  # Qwen3-MoE, Mixtral, Qwen 3.5's, gpt-oss
        assert checks["output"] <= 1e-5 * checks["scale"] and checks["gradients"] < 1e-4, (name, checks)
    for case, (ours, theirs) in found["aux"].items():  # transformers' load_balancing_loss_func
        assert abs(ours - theirs) <= 1e-5, (case, ours, theirs)
    capacity = found["capacity"]
    assert capacity["dropped"] == capacity["by_hand"] > 0 and capacity["dropless_dropped"] == 0, capacity
    assert capacity["per_expert"] == capacity["by_hand_per_expert"], capacity
    assert capacity["mesh_dropped"] == capacity["mesh_by_hand"] > 0, capacity
    for output in ("output", "dropless_output", "mesh_output", "mesh_dropless_output"):
        assert capacity[output] <= 1e-5 * capacity["scale"], (output, capacity)
    for mesh, checks in found["exchange"].items():  # each copy to its expert's device and back
        assert checks["output"] <= 1e-5 * checks["scale"] and checks["gradients"] < 1e-5, (mesh, checks)
        assert checks["per_expert"] == checks["by_hand_per_expert"], (mesh, checks)
    flops = found["flops"]  # compiled for a TPU v5e chip: within 1.25x of top_k / E of the dense bank's
    assert flops["ratio"] <= 1.25 * flops["top_k_over_experts"], flops
    # On a TPU the expert axis exchanges copies by ragged all-to-all, and sends less than the gather
    exchange, gather = found["tpu_exchange"]["all_to_all"], found["tpu_exchange"]["gather"]
    assert exchange["ragged_all_to_all"] >= 2 and gather["ragged_all_to_all"] == 0, found["tpu_exchange"]
    assert exchange["sent"]["all_to_all"] > 0 and exchange["sent"]["total"] < gather["sent"]["total"], \
        found["tpu_exchange"]


def test_a_copy_rebuilt_in_the_same_process_names_its_unnamed_layers_as_the_model_did():
    """keras-hub's MoE blocks are built unnamed, so Keras numbers them per process
    ('qwen3_sparse_moe_block_2'); the export's host copy pairs weights by path."""
    import keras
    from tpu_keras.models import weight_paths

    class Block(keras.layers.Layer):  # builds an unnamed sublayer, as keras-hub's decoders do
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = keras.layers.Dense(2)

        def call(self, x):
            return self.inner(x)

    def model():
        inputs = keras.Input((3,))
        return keras.Model(inputs, Block(name="first")(Block(name="second")(keras.layers.Dense(3)(inputs))))

    original = model()
    keras.layers.Dense(2)  # the process builds more unnamed layers before the copy
    plain = model()
    with weight_paths.numbered_like(original):
        copy = model()
    assert sorted(weight_paths.weights(plain)) != sorted(weight_paths.weights(original))
    assert sorted(weight_paths.weights(copy)) == sorted(weight_paths.weights(original))
    later = keras.layers.Dense(2)  # names stay unique in the process after the copy
    assert later.name not in {layer.name for layer in copy._flatten_layers()}


@pytest.mark.slow  # 20 s: jax's start and compiles, beyond the fast tier's share
def test_the_savedmodels_dense_experts_and_sorted_top_k_are_the_sparse_layers():
    """A SavedModel's trace (symbolic shapes) takes `served` and the top k by a sort."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tpu_keras.models import moe
    draw = np.random.default_rng(0)
    tokens, experts, hidden, units, k = 64, 8, 16, 8, 2
    x = jnp.asarray(draw.normal(size=(tokens, hidden)), jnp.float32)
    logits = jnp.asarray(draw.normal(size=(tokens, experts)), jnp.float32)
    logits = logits.at[0, 1].set(logits[0, 5])  # a tie: the lower expert first, as top_k takes it
    bank = moe.Bank(*(jnp.asarray(draw.normal(size=shape), jnp.float32) for shape in (
        (experts, hidden, units), (experts, hidden, units), (experts, units, hidden))))
    activation = lambda gate, up: jax.nn.silu(gate) * up
    for softmax_first in (True, False):
        weights, chosen = moe.select(logits, k, softmax_first, True)
        sorted_weights, sorted_chosen = moe.select(logits, k, softmax_first, True, by_sort=True)
        np.testing.assert_array_equal(chosen, sorted_chosen)
        np.testing.assert_array_equal(weights, sorted_weights)
    sparse, _, _ = moe._local(x, weights, chosen, bank, activation=activation, num_experts=experts,
                              capacity_factor=0.0, axes=None, tiled=True)
    dense = moe.served(x, weights, chosen, bank, activation, experts)
    assert float(jnp.max(jnp.abs(sparse - dense))) <= 1e-6 * float(jnp.max(jnp.abs(sparse)))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_families_start_from_transformers_logits_and_export_round_trips(tmp_path, data_dir):
    runs = tuple(f"{name}:{run}" for name in FAMILIES for run in ("export", "aux")
                 if run == "export" or name not in WITHOUT_BALANCING_LOSS)
    result = probe("jax", tmp_path, data_dir, "1,1,1", runs, FAMILIES)
    for name in FAMILIES:
        assert relative(result, name, result[name]["first_step"]) <= TRANSFORMERS, (name, result[name])
        if name not in WITHOUT_BALANCING_LOSS:
            aux = result[name]["aux"]  # the run's loss term over its coefficient, transformers' own
            assert abs(aux["toolkit"] - aux["transformers"]) <= 1e-5, (name, aux)
        checks = result[name]["export"]
        assert checks["problems"] == [] and checks["config"] == {}, (name, checks)
        assert relative(result, name, checks["torch"]) <= TRANSFORMERS, (name, checks)
        assert checks["toolkit"] <= TOLERANCE, (name, checks)


@pytest.mark.slow
def test_a_moe_run_logs_its_experts_load_exports_a_savedmodel_and_block_remat_refuses_its_loss(
        tmp_path, data_dir):
    """The SavedModel's trace has a symbolic batch, which the sparse layer cannot sort: it is
    written with keras-hub's dense bank, the same function. train.remat='blocks' recomputes
    each block apart, and the balancing loss gathers all of them: refused unless it is off.
    A run under a capacity logs its busiest expert's share of the tokens and the copies dropped."""
    folder = tmp_path / "qwen3_moe"
    hf_pretrained.write(folder, "qwen3_moe")
    base = ["--config.train.remat=blocks", "--config.train.steps=4", "--config.log.every_steps=2",
            "--config.train.batch_size=4", f"--config.data.data_dir={data_dir}",
            f"--config.model.preset={folder}"]
    config = "tests/helpers/checkpoint_config.py:Qwen3MoeCausalLM"
    runs = run_in_one_process("tpu_keras.train", {
        "with_loss": train_args(config, tmp_path / "refused", *base),
        "without_loss": train_args(config, tmp_path / "run", *base,
                                   "--config.model.router_aux_loss_coefficient=0")})
    capacity = train(config, tmp_path / "capacity", *base[1:], "--config.model.moe_capacity_factor=1.0",
                     "--config.export.formats=('keras_hub',)").stdout  # a process of its own: it logs
    lines = [line for line in capacity.splitlines() if "step 4/4 |" in line]
    load = dict(re.findall(r"(experts_busiest|experts_dropped) ([0-9.e-]+)", lines[-1]))
    assert 2 / 8 <= float(load["experts_busiest"]) <= 1 and 0 <= float(load["experts_dropped"]) < 1, lines
    assert_one_line_error(runs["with_loss"], "train.remat='blocks'", "train.remat='none'",
                          "model.router_aux_loss_coefficient=0")
    assert runs["without_loss"].returncode == 0, runs["without_loss"].stderr[-3000:]
    served = run_command([sys.executable, "-c", (
        "import numpy as np, tensorflow as tf, sys\n"
        f"loaded = tf.saved_model.load({str(tmp_path / 'run' / 'export')!r})\n"
        "logits = loaded.serve(tf.constant(np.arange(3 * 64).reshape(3, 64) % 200, tf.int32)).numpy()\n"
        "print('SERVED', logits.shape, bool(np.isfinite(logits).all()))")]).stdout
    assert "SERVED (3, 64, " in served and served.rstrip().endswith("True"), served[-2000:]


def test_gpt_oss_attends_within_transformers_windows_and_reads_transformers_5s_yarn_factor():
    """keras-hub 0.32 puts the window on the odd blocks, of window + 1 keys; transformers on the
    even ones, of window keys. Its converter reads the YaRN factor from `rope_scaling` alone."""
    import keras_hub
    from tpu_keras.models.families import gpt_oss
    backbone = keras_hub.models.GptOssBackbone(
        vocabulary_size=16, num_layers=3, num_query_heads=2, num_key_value_heads=1, hidden_dim=8,
        intermediate_dim=4, num_experts=2, top_k=1, head_dim=4, sliding_window=8)
    gpt_oss.repair(backbone)
    assert [block.self_attention_layer.sliding_window for block in backbone.transformer_layers] == [7, None, 7]
    rope = {"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 4096, "truncate": False}
    assert gpt_oss.read_config({"num_hidden_layers": 2, "rope_parameters": rope}) == {"rope_scaling_factor": 32.0}


def test_active_parameters_count_top_k_of_the_experts_banks_and_everything_else():
    """The plan's active parameters (MaxText's): the banks at top_k / E, every other weight whole."""
    import math
    import keras_hub
    from tpu_keras.models import moe
    backbone = keras_hub.models.GptOssBackbone(
        vocabulary_size=16, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=8,
        intermediate_dim=4, num_experts=4, top_k=1, head_dim=4, sliding_window=8)
    moe.route_blocks(backbone)
    total = sum(math.prod(weight.shape) for weight in backbone.weights)
    bank = 4 * (8 * 8 + 8 + 4 * 8 + 8)  # E x (gate and up (H, 2F), their bias, down (F, H), its bias)
    assert moe.parameters(backbone) == {"total": total, "active": total - 2 * bank + 2 * bank // 4,
                                        "experts": 4, "top_k": 1}
    assert moe.parameters(keras_hub.models.LlamaBackbone(
        vocabulary_size=16, num_layers=1, num_query_heads=2, num_key_value_heads=1, hidden_dim=8,
        intermediate_dim=4)) is None


@pytest.mark.slow
def test_moe_bad_inputs_are_one_line(tmp_path):
    moe_folder, dense_folder = tmp_path / "qwen3_moe", tmp_path / "qwen3"
    hf_pretrained.write(moe_folder, "qwen3_moe")
    hf_pretrained.write(dense_folder, "qwen3")
    base = {"moe": ["--config=tests/helpers/checkpoint_config.py:Qwen3MoeCausalLM",
                    f"--config.model.preset={moe_folder}", "--config.engine=jax"],
            "dense": ["--config=tests/helpers/checkpoint_config.py:Qwen3CausalLM",
                      f"--config.model.preset={dense_folder}", "--config.engine=jax"]}
    cases = {
        "indivisible": base["moe"] + ["--config.mesh.expert=3", "--devices=3"],
        "dense": base["dense"] + ["--config.mesh.expert=2", "--devices=2"],
        "capacity": base["moe"] + ["--config.model.moe_capacity_factor=0"],
        "capacity_dense": base["dense"] + ["--config.model.moe_capacity_factor=1.25"],
    }
    for case, changes in {"gpt_oss_layers": {"layer_types": ["full_attention", "sliding_attention"]},
                          "gpt_oss_coefficient": {"router_aux_loss_coef": 0.5}}.items():
        hf_pretrained.write(tmp_path / case, "gpt_oss", **changes)
        cases[case] = ["--config=tests/helpers/checkpoint_config.py:GptOssCausalLM",
                       f"--config.model.preset={tmp_path / case}", "--config.engine=jax"]
    gpt_oss = ["--config=tests/helpers/checkpoint_config.py:GptOssCausalLM", "--config.engine=jax",
               f"--config.model.preset={tmp_path / 'gpt_oss_layers'}"]  # any gpt-oss checkpoint: refused first
    cases["experts_without_rank"] = base["moe"] + ["--config.model.lora_target_parameters=mlp.experts.gate_up_proj"]
    cases["experts_misnamed"] = gpt_oss + ["--config.model.lora_rank=4",
                                           "--config.model.lora_target_parameters=mlp.experts.gate_proj"]
    layouts = run_in_one_process("tpu_keras.layout", cases)
    assert_refused(layouts["gpt_oss_layers"], "layer_types ['full_attention', 'sliding_attention']",
                   "starting with a sliding one")
    assert_refused(layouts["gpt_oss_coefficient"], "router_aux_loss_coef 0.5", "transformers' 0.9")
    assert_refused(layouts["indivisible"], "expert", "3")
    assert_refused(layouts["dense"], "mesh.expert=2", "has none", "mesh.data or mesh.fsdp")
    assert_refused(layouts["capacity"], "model.moe_capacity_factor=0 keeps no token", "leave it out")
    assert_refused(layouts["capacity_dense"], "model.moe_capacity_factor=1.25", "has none; drop it")
    assert_refused(layouts["experts_without_rank"], "model.lora_target_parameters", "model.lora_rank is 0")
    assert_refused(layouts["experts_misnamed"], "'mlp.experts.gate_proj'",
                   "choose from mlp.experts.gate_up_proj, mlp.experts.down_proj")
    # On the tf engine: mesh.resolve's "mesh.expert=2 needs the jax engine" (test_mesh_and_rules.py).


@pytest.mark.slow
def test_each_moe_familys_lora_step_compiles_for_a_tpu_with_its_experts_exchanged_by_all_to_all(tmp_path):
    """`plan --measure` compiles each family's LoRA step for a v5e-8 on expert 2 x fsdp 2 x model 2
    (libtpu): it fits, and its copies reach their experts by ragged all-to-all."""
    calls = {}
    for name in FAMILIES:
        hf_pretrained.write(tmp_path / name, name)
        calls[name] = ["--config=configs/finetune.py", "--tpu=v5litepod-8", "--measure",
                       f"--config.model.name=keras_hub:{hf_pretrained.TASKS[name]}",
                       f"--config.model.preset={tmp_path / name}", "--config.mesh.expert=2",
                       "--config.mesh.fsdp=2", "--config.mesh.model=2", "--config.train.batch_size=8",
                       "--config.model.context_length=64"]
    plans = run_in_one_process("tpu_keras.plan", calls, timeout=900)
    assert sorted(plans) == sorted(FAMILIES), sorted(plans)
    for name, result in plans.items():
        assert result.returncode == 0, (name, result.stdout[-3000:], result.stderr[-3000:])
        assert "fits by the TPU compiler: yes" in result.stdout, (name, result.stdout[-3000:])
        assert re.search(r"ragged-all-to-all .* over +2 devices", result.stdout), (name, result.stdout[-3000:])


def test_lora_on_the_experts_is_refused_on_the_tf_engine_which_computes_them_densely():
    """keras-hub's dense bank (the tf engine's) reads the experts' weights alone: a LoRA of
    them would not be applied, so PEFT's target_parameters there is one line."""
    import keras
    from tpu_keras.errors import UserError
    from tpu_keras.models import expert_lora
    from tpu_keras.models.families import gpt_oss
    assert keras.backend.backend() == "tensorflow"
    with pytest.raises(UserError, match="tf engine computes with keras-hub's dense bank.*engine=jax"):
        expert_lora.chosen({expert_lora.KEY: "mlp.experts.down_proj"}, gpt_oss.EXPERT_TARGETS, "gpt_oss")


def test_the_planner_traces_one_device_of_the_expert_axis_and_counts_no_slice_of_a_weight():
    """The planner's trace (`traced_as_on_a_tpu`) has the shapes a TPU device of the expert axis
    has: the axis's tokens in the grouped matmul (ragged_dot), its own experts; under a capacity,
    its own experts' slots. A slice of a weight (Qwen3-MoE's gate half) is the weight, counted
    among the parameters, not an activation."""
    import jax
    import jax.numpy as jnp
    from tpu_keras.models import moe
    from tpu_keras.planning import activations
    tokens, hidden, units, experts, k, axis = 16, 8, 4, 8, 2, 4
    x = jnp.zeros((tokens, hidden))
    weights, chosen = jnp.full((tokens, k), 0.5), jnp.zeros((tokens, k), jnp.int32)
    bank = moe.Bank(jnp.zeros((experts, hidden, units)), jnp.zeros((experts, hidden, units)),
                    jnp.zeros((experts, units, hidden)))

    def equations(capacity_factor, expert_axis):
        with moe.traced_as_on_a_tpu(expert_axis):
            traced = jax.make_jaxpr(lambda *a: moe.experts_of(*a, moe._silu_glu, experts, capacity_factor))(
                x, weights, chosen, bank)
        return [(e.primitive.name, [tuple(v.aval.shape) for v in e.invars]) for e in traced.jaxpr.eqns]

    ragged = [shapes for name, shapes in equations(0.0, axis) if name == "ragged_dot_general"]
    assert ragged and all(s[0] == (axis * tokens * k, hidden) and s[1][0] == experts // axis
                          for s in ragged[:2]), ragged
    assert [s for name, s in equations(0.0, 1) if name == "ragged_dot_general"][0][0] == (tokens * k, hidden)
    slots = [shapes for name, shapes in equations(1.25, axis) if name == "dot_general"]
    limit = moe.capacity(1.25, axis * tokens, k, experts)
    assert ((experts // axis, limit, hidden), (experts // axis, hidden, units)) in [tuple(s) for s in slots], slots

    def kept(loss, kernels):  # the residual bytes of `loss`'s gradient for the frozen `kernels`' input
        traced = jax.make_jaxpr(lambda w, h: jax.vjp(lambda h: loss(w, h), h)[1])(kernels, x)
        return activations.residual_bytes(traced, None)
    fused = kept(lambda w, h: jnp.sum(jnp.sin(h @ w[:, :units]) * (h @ w[:, units:])),
                 jnp.ones((hidden, 2 * units)))
    apart = kept(lambda w, h: jnp.sum(jnp.sin(h @ w[0]) * (h @ w[1])),
                 (jnp.ones((hidden, units)), jnp.ones((hidden, units))))
    assert fused == apart > 0, (fused, apart)  # the kernel's halves are not counted
