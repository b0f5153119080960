"""`python -m tpu_keras.plan`: memory per device on a TPU slice, checked against what can run here.

The exact figures (parameters, optimizer state) are checked against really
sharded variables in test_parallel.py; here the activation estimate meets
XLA's own buffer assignment, and the planner's answers meet each other.
"""

import json
import sys

import pytest

from conftest import assert_one_line_error, run_command, run_in_one_process


# float32: with bf16, CPU XLA keeps float32 copies that a TPU does not (tpu_keras.planning.compiled_step).
FLOAT32 = "--config.train.precision=float32"
# These check the plan against XLA:CPU on fake devices; the TPU compiler: test_tpu_compiler.py.
CPU = "--compiler=cpu"
# The plan counts the activations a TPU keeps. XLA:CPU fuses less: it also keeps what the TPU
# compiler remakes in the backward pass (softmax's output beside its exponentials, a float32
# copy beside its source). So the plan is under XLA:CPU's memory (0.6-0.85 of it here), never
# above it by more than XLA's workspace would hide.
UNDER_CPU = (0.55, 1.05)
GPT = ["--config=configs/lm_stdlib.py", "--tpu=v5litepod-8"]
# keras-hub's Llama over fsdp=8, its 4,096-element weights split too, 1 sequence per device.
LLAMA_FSDP = ["--config=configs/llama_stdlib.py", "--tpu=v5litepod-8", FLOAT32, "--config.engine=jax",
              "--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.layout.replicate_below=4096",
              "--config.train.batch_size=8", "--measure", CPU, "--json"]
LONG = ["--config=configs/llama_stdlib.py", "--tpu=v5litepod-4", "--config.engine=jax",
        "--config.train.batch_size=2", "--config.model.context_length=2048", "--margin=0.9993"]
BAD_INPUTS = {
    "unknown-slice": (["--tpu=v4-31"], ["TPU slice 'v4-31' does not exist"]),
    "indivisible-batch": (["--tpu=v5p-64", "--config.train.batch_size=33"],
                          ["train.batch_size=33 does not divide over the 32 batch splits (data x fsdp x expert)",
                           "multiple of 32"]),
    "tf-model-axis": (["--tpu=v4-8", "--config.mesh.model=2"], ["needs the jax engine"]),
    "margin": (["--tpu=v4-8", "--margin=1.5"], ["--margin=1.5"]),
    "multislice-v3": (["--tpu=2xv3-32"], ["Cloud TPU offers multislice on v4, v5e, v5p, v6e only, not on v3"]),
    "slices-mismatch": (["--tpu=v4-32", "--config.engine=jax", "--config.mesh.slices=2"],
                        ["mesh.slices=2 but --tpu=v4-32 is 1 slice(s)", "--tpu=2xv4-32"]),
    # What train refuses, plan refuses in the same line (config.check, before either plans or runs).
    "grpo-completion-fills-the-context": (
        ["--config=configs/grpo_stdlib.py:tiny", "--tpu=v5litepod-4",
         "--config.grpo.max_completion_length=100000"],
        ["grpo.max_completion_length=100000 leaves no room for a prompt in model.context_length=16"]),
}


@pytest.fixture(scope="module")
def plans():
    """Every plan below that compiles nothing, in two processes (a start of JAX and Keras
    each): the second asks for the largest batch the first found, and one more."""
    done = run_in_one_process("tpu_keras.plan", {
        "gpt": GPT + ["--json"],
        "auto_table": GPT + ["--auto"],
        "auto_json": GPT + ["--auto", "--json"],
        "auto_1b_v5p_64": ["--config=configs/lm_stdlib.py:1b", "--tpu=v5p-64", "--auto", "--json"],
        "auto_two_slices": ["--config=configs/lm_stdlib.py:1b", "--tpu=2xv5litepod-256", "--auto"],
        "dpo": ["--config=configs/preference_stdlib.py", "--tpu=v5litepod-8", "--json"],
        "dpo_text": ["--config=configs/preference_stdlib.py", "--tpu=v5litepod-8"],
        "dpo_full": ["--config=configs/preference_stdlib.py", "--tpu=v5litepod-8",
                     "--config.model.lora_rank=0", "--json"],
        "sft_same_model": ["--config=configs/preference_stdlib.py", "--tpu=v5litepod-8",
                           "--config.data.preferences.files=", "--json"],
        # keras-hub's Llama at 512 tokens: on the jax engine a TPU run takes the fused kernel.
        "llama_512_jax": ["--config=configs/llama_stdlib.py", "--tpu=v5litepod-8", "--config.engine=jax",
                          "--config.model.context_length=512", "--json"],
        "llama_512_tf": ["--config=configs/llama_stdlib.py", "--tpu=v5litepod-8", "--config.engine=tf",
                         "--config.model.context_length=512", "--json"],
        # 2,048 tokens with 11.8 MB of HBM a device: one sequence's activations do not fit
        # whole, and split over a context axis they do.
        "long_auto": LONG + ["--auto", "--json"],
        "long_whole": LONG + ["--config.mesh.data=2", "--config.mesh.model=2"],
        "long_whole_json": LONG + ["--config.mesh.data=2", "--config.mesh.model=2", "--json"],
        "long_split_json": LONG + ["--config.mesh.data=1", "--config.mesh.context=2",
                                   "--config.mesh.model=2", "--json"],
        # layout.sequence_parallel: the residual stream split along the sequence over model
        **{f"stream_{split}": ["--config=configs/llama_stdlib.py", "--tpu=v5litepod-4",
                               "--config.engine=jax", "--config.mesh.data=2", "--config.mesh.model=2",
                               "--config.train.remat=blocks", "--config.train.batch_size=2",
                               f"--config.layout.sequence_parallel={split}", "--json"]
           for split in (False, True)},
        "nothing_fits": ["--config=configs/lm_stdlib.py", "--tpu=v5e-1", "--config.model.width=16384",
                         "--config.model.depth=1", "--auto"],
        **{f"bad:{name}": (args if args[0].startswith("--config=") else ["--config=configs/lm_stdlib.py", *args])
           for name, (args, _) in BAD_INPUTS.items()},
    }, timeout=400)
    largest = json.loads(done["gpt"].stdout)["largest_global_batch"]
    return {**done, **run_in_one_process("tpu_keras.plan", {
        "gpt_at_largest": GPT + [f"--config.train.batch_size={largest}", "--json"],
        "gpt_one_more": GPT + [f"--config.train.batch_size={largest + 8}"]})}


@pytest.fixture(scope="module")
def measured():
    """The plans that XLA:CPU checks, on 8 fake devices, in one process: each call
    after the first also shows that a plan leaves no mesh or dtype policy behind (the
    third call's optimizer slots would otherwise be placed by the first call's mesh)."""
    done = run_in_one_process("tpu_keras.plan", {
        "auto": GPT + [FLOAT32, "--auto", "--measure", CPU, "--json"],
        "three_axes": GPT + [FLOAT32, "--config.engine=jax", "--config.mesh.data=2", "--config.mesh.fsdp=2",
                             "--config.mesh.model=2", "--measure", CPU, "--json"],
        "two_slices_bf16": ["--config=configs/lm_stdlib.py", "--tpu=2xv5litepod-4", "--config.engine=jax",
                            "--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.model=2",
                            "--config.train.precision=mixed_bfloat16", "--measure", CPU, "--json"],
        "pure_fsdp": GPT + [FLOAT32, "--config.engine=jax", "--config.mesh.data=1", "--config.mesh.fsdp=8",
                            "--config.model.width=512", "--config.model.num_heads=8",
                            "--config.model.context_length=512", "--config.data.tfds.name=stdlib_bytes/ctx512",
                            "--config.train.batch_size=8", "--measure", CPU, "--json"],
        "llama_remat_none": LLAMA_FSDP + ["--config.train.remat=none"],
        "llama_remat_blocks": LLAMA_FSDP + ["--config.train.remat=blocks"],
        "llama_auto": ["--config=configs/llama_stdlib.py", "--tpu=v5litepod-8", "--config.engine=jax",
                       "--auto", "--json"],
        # a vocabulary of 16,384 against 1,024 tokens a step: the head outweighs the hidden states
        "llama_head_gathered": LLAMA_FSDP + ["--config.model.vocabulary_size=16384"],
        "llama_logits_split": LLAMA_FSDP + ["--config.model.vocabulary_size=16384",
                                            "--config.layout.split_logits=True"],
    }, timeout=600)
    for name, result in done.items():
        assert result.returncode == 0, (name, result.stderr[-2000:])
    return {name: json.loads(result.stdout) for name, result in done.items()}


@pytest.mark.slow
def test_auto_recommendation_matches_the_compiled_sharded_step(measured):
    # --auto on 8 devices picks a layout; --measure compiles that layout's real training
    # step on 8 fake CPU devices and reads XLA's memory_analysis().
    result = measured["auto"]
    best, measured = result["recommended"], result["measured"]
    assert best["fits"] and measured["devices"] == 8 and measured["backend"] == "cpu"
    assert UNDER_CPU[0] <= best["per_device"]["total"] / measured["total"] <= UNDER_CPU[1], (best, measured)
    assert UNDER_CPU[0] <= best["per_device"]["activations"] / measured["activations"] <= UNDER_CPU[1]
    # Data parallel: the gradients' all-reduce is all the compiled step sends, to the byte's width.
    sent, compiled = best["sent_per_step"]["total"], measured["sent_per_step"]["total"]
    assert abs(sent / compiled - 1) <= 0.02, (best["sent_per_step"], measured["sent_per_step"])


@pytest.mark.slow
def test_plan_against_the_compiled_sharded_step_on_three_axes(measured):
    # data, fsdp and model at once (fsdp alone and data alone: the tests around this one).
    result = measured["three_axes"]
    measured = result["measured"]
    assert UNDER_CPU[0] <= result["per_device"]["total"] / measured["total"] <= UNDER_CPU[1], (result, measured)
    # The plan counts fsdp's all-gather twice (ZeRO-3) and a reduce-scatter where CPU XLA
    # keeps the gathered weights and all-reduces: within 25% of what the program sends.
    sent = result["sent_per_step"]["total"] / measured["sent_per_step"]["total"]
    assert 0.75 <= sent <= 1.25, (result["sent_per_step"], measured["sent_per_step"])


@pytest.mark.slow
def test_two_slices_in_bf16_send_what_the_partitioned_step_sends(measured):
    # 2 slices of 4 fake devices (slices=2 x fsdp=2 x model=2), in mixed_bfloat16 as on a
    # TPU. XLA:CPU widens bf16 collectives to float32 (8.70 MiB where the partitioner's
    # program sends 4.66); --measure counts the partitioner's and says so.
    result = measured["two_slices_bf16"]
    measured, sent = result["measured"], result["sent_per_step"]
    assert result["slices"] == 2 and result["devices"] == 8 and measured["slices"] == 2
    assert abs(sent["total"] / measured["sent_per_step"]["total"] - 1) <= 0.15, (sent, measured)
    assert measured["cpu_sent_per_step"]["total"] > 1.5 * measured["sent_per_step"]["total"]
    # Across slices: only the gradients' all-reduce, hierarchically, a shard per device.
    across = sent["gradient_all_reduce_across_slices"]
    compiled = sum(v for k, v in measured["sent_per_step"].items() if k.endswith("_across_slices"))
    assert across > 0 and abs(across / compiled - 1) <= 0.15, (sent, measured["sent_per_step"])
    assert result["network"]["across_slices"] == across
    assert result["network"]["dcn_seconds"] > 0 and result["network"]["ici_seconds"] > 0


@pytest.mark.slow
def test_auto_on_two_v5e_256_slices_puts_data_parallelism_across_them(plans):
    assert plans["auto_two_slices"].returncode == 0, plans["auto_two_slices"].stderr[-2000:]
    text = plans["auto_two_slices"].stdout
    assert "on 2 x v5litepod-256: 512 devices on 128 host(s)" in text
    assert "recommended: slices=2 x data=" in text and "the least estimated communication time" in text
    assert "across the 2 slices" in text and "(DCN, " in text and "(ICI, " in text
    assert "--config.mesh.slices=2" in text


@pytest.mark.slow
def test_the_fused_attention_kernel_keeps_no_scores(plans):
    # A jax run on the TPU routes keras-hub's Llama through splash attention
    # (models.splash_attention), which keeps no scores; the plan traces that kernel. On the
    # tf engine, XLA's attention keeps each layer's float32 softmax, and the plan counts it.
    # The kernel keeps a few small tensors of its own (a row's statistics), hence the 1%.
    jax_plan, tf_plan = (json.loads(plans[name].stdout) for name in ("llama_512_jax", "llama_512_tf"))
    layers, heads, length, rows = 2, 4, 512, jax_plan["per_replica_batch"]
    scores = layers * rows * heads * length * length * 4
    saved = tf_plan["per_device"]["activations"] - jax_plan["per_device"]["activations"]
    assert 0.99 * scores <= saved <= 1.1 * scores, (saved, scores)


SHARED_PROGRAM = """
from tpu_keras.cluster import engine
engine.select("jax")
import jax, jax.numpy as jnp
from tpu_keras.planning import activations
layer = jax.jit(lambda x: jnp.sin(x) * x)  # one traced program, whichever call runs it
def residuals(f):
    return activations.residual_bytes(jax.make_jaxpr(lambda x: jax.vjp(f, x)[1])(jnp.ones((256, 256))), None)
print(residuals(lambda x: layer(x).sum()), residuals(lambda x: layer(layer(x)).sum()))
"""


def test_each_call_of_a_shared_program_keeps_its_own_residuals():
    # JAX traces a jitted function once per shape and shares that program among its calls
    # (every layer's activation). Each call's residuals are its own tensors: one call keeps
    # sin(x) and cos(x); two keep those, and the first call's output, from which the second
    # call's sine and cosine are cheap to remake.
    one, two = map(int, run_command([sys.executable, "-c", SHARED_PROGRAM], merge_stderr=False).stdout.split())
    tensor = 256 * 256 * 4
    assert (one, two) == (2 * tensor, 3 * tensor)


@pytest.mark.slow
def test_auto_splits_a_sequence_only_when_nothing_fits_whole(plans):
    """`--auto` searches data x fsdp x model first and a context axis only when no whole
    sequence fits; the plain plan says that one sequence's activations are what does not fit."""
    auto = json.loads(plans["long_auto"].stdout)
    by_context = {}
    for c in auto["candidates"]:
        by_context.setdefault(c["mesh"]["context"], []).append(c["fits"])
    assert not any(by_context[1]) and any(by_context[2]), by_context
    assert set(by_context) == {1, 2}  # it stopped at the first size that fits
    assert "--config.mesh.context=2" in auto["flags"], auto["flags"]
    # a device along context sends its share of the sequences over the model axis: half of
    # each of 2 sequences (data=1 x context=2) is one whole sequence (data=2)
    split, whole = (json.loads(plans[name].stdout)["sent_per_step"]["model_all_reduce"]
                    for name in ("long_split_json", "long_whole_json"))
    assert split == whole > 0, (split, whole)
    whole = plans["long_whole"].stdout
    assert "fits: NO" in whole and "one sequence's activations" in whole, whole[-1500:]
    assert "mesh.context" in whole and "alone fill HBM" not in whole, whole[-1500:]


@pytest.mark.slow
def test_a_residual_stream_split_along_the_sequence_counts_once_per_shard(plans):
    """With layout.sequence_parallel, what the backward pass keeps of the residual stream
    (under remat 'blocks', each block's input) counts once per model shard."""
    whole, split = (json.loads(plans[f"stream_{s}"].stdout)["per_device"] for s in (False, True))
    assert split["activations"] < whole["activations"], (whole, split)
    assert split["parameters"] == whole["parameters"], (whole, split)


@pytest.mark.slow
def test_nothing_fits_exits_1(plans):
    result = plans["nothing_fits"]
    assert result.returncode == 1 and "nothing fits" in result.stdout, result.stdout[-2000:]


@pytest.mark.slow
def test_pure_fsdp_gathers_weights_not_activations(measured):
    # Without the layer outputs held to the batch split, XLA met this model's fsdp-split
    # weights by reshuffling activations: 3.3x the plan's memory (then counted as XLA:CPU
    # keeps it), 3x its traffic.
    result = measured["pure_fsdp"]
    measured = result["measured"]
    assert UNDER_CPU[0] <= result["per_device"]["total"] / measured["total"] <= UNDER_CPU[1], (result, measured)
    sent = result["sent_per_step"]["total"] / measured["sent_per_step"]["total"]
    assert abs(sent - 1) <= 0.05, (result["sent_per_step"], measured["sent_per_step"])


@pytest.mark.slow
def test_blocks_remat_keeps_each_blocks_input_alone_and_gathers_its_weights_again(measured, plans):
    """train.remat='blocks' (models.block_remat) under fsdp: the compiled step keeps less, as
    each block's activations and gathered weights are made again in the backward pass, and
    so gathers the blocks' weights twice; the plan counts the block inputs and one block's
    insides."""
    kept, remade = measured["llama_remat_none"], measured["llama_remat_blocks"]
    assert remade["measured"]["temporaries"] < kept["measured"]["temporaries"], (kept, remade)
    gathered = [run["measured"]["sent_per_step"]["all_gather"] for run in (kept, remade)]
    assert gathered[1] >= 1.5 * gathered[0] > 0, gathered
    # the plan: the blocks' inputs, and one of the two blocks' insides while its backward runs
    assert remade["per_device"]["activations"] < 0.75 * kept["per_device"]["activations"], (kept, remade)
    # --auto weighs it for a model with transformer blocks (keras-hub's), not for the gpt
    assert {c["remat"] for c in measured["llama_auto"]["candidates"]} == {"none", "activations", "blocks"}
    assert {c["remat"] for c in json.loads(plans["auto_json"].stdout)["candidates"]} == {"none", "activations"}


@pytest.mark.slow
def test_logits_split_over_the_vocabulary_gather_the_hidden_states_not_the_head(measured):
    """layout.split_logits (models.vocabulary_split): each device multiplies the step's
    gathered hidden states by its own slice of the head, so the step never holds the
    whole head."""
    gathered, split = (measured[name]["measured"] for name in ("llama_head_gathered", "llama_logits_split"))
    assert split["temporaries"] < 0.7 * gathered["temporaries"], (gathered, split)
    sent = [run["sent_per_step"]["all_gather"] for run in (gathered, split)]
    assert sent[1] < sent[0], sent


@pytest.mark.slow
def test_auto_plans_a_billion_parameter_gpt_on_a_v5p_64(plans):
    result = json.loads(plans["auto_1b_v5p_64"].stdout)
    assert 0.95e9 < result["parameters"] < 1.05e9 and result["devices"] == 32
    fitting = [c for c in result["candidates"] if c["fits"]]
    best = result["recommended"]
    assert fitting and best == fitting[0]
    # One slice: every byte crosses the chip interconnect, so least time is least bytes.
    assert best["sent_per_step"]["total"] == min(c["sent_per_step"]["total"] for c in fitting)
    for c in fitting:  # every candidate trains the config's 512 examples per update, in memory
        mesh = c["mesh"]
        assert mesh["data"] * mesh["fsdp"] * mesh["model"] == 32
        assert c["batch_per_replica"] * c["grad_accum_steps"] * mesh["data"] * mesh["fsdp"] == 512
        assert c["per_device"]["total"] <= result["usable_bytes_per_device"]
        assert (c["sent_per_step"]["model_all_reduce"] > 0) == (mesh["model"] > 1)
        assert (c["sent_per_step"]["fsdp_all_gather"] > 0) == (mesh["fsdp"] > 1)
    # Data parallel alone: each device sends 2 x 31/32 of the gradients per micro-batch, in
    # bf16 where the model reads the weight in bf16 (the kernels), float32 elsewhere.
    data_only = next(c for c in fitting if c["mesh"] == {"data": 32, "fsdp": 1, "expert": 1, "context": 1, "model": 1})
    gradients = 2 * 31 / 32 * data_only["per_device"]["gradients"] * data_only["grad_accum_steps"]
    assert 0.5 * gradients < data_only["sent_per_step"]["total"] < 0.51 * gradients
    # Splitting the weights over fsdp shrinks them by the axis size.
    fsdp = next(c for c in fitting if c["mesh"] == {"data": 1, "fsdp": 32, "expert": 1, "context": 1, "model": 1})
    assert fsdp["per_device"]["parameters"] < data_only["per_device"]["parameters"] / 16
    assert any("model=32" in f"model={s['mesh']['model']}" and "does not divide" in s["reason"]
               for s in result["skipped"])
    m = best["mesh"]
    assert f"--config.mesh.data={m['data']} --config.mesh.fsdp={m['fsdp']}" in result["flags"]


@pytest.mark.slow
def test_auto_table_ends_with_the_flags_to_use(plans):
    text, result = plans["auto_table"].stdout, json.loads(plans["auto_json"].stdout)
    assert "data  fsdp  model  remat" in text and "skipped data=1 x model=8" in text
    assert text.rstrip().endswith(result["flags"])


@pytest.mark.slow
def test_the_largest_batch_fits_and_one_more_per_replica_does_not(plans):
    # The 5-minute gpt on a v5litepod-8 in bf16: 8 replicas of 15.75 GiB (what a v5e device reports).
    first = json.loads(plans["gpt"].stdout)
    assert first["fits"] and first["devices"] == 8 and first["hosts"] == 1
    assert first["mesh"] == {"data": 8, "fsdp": 1, "expert": 1, "context": 1, "model": 1} and first["precision"] == "mixed_bfloat16"
    assert first["per_device"]["gradients"] == first["per_device"]["parameters"]  # all trainable
    largest = first["largest_global_batch"]
    assert largest % 8 == 0 and largest > first["global_batch"]
    at_largest = json.loads(plans["gpt_at_largest"].stdout)
    assert at_largest["fits"] and at_largest["largest_global_batch"] == largest
    # One more example per replica: the table says it does not fit, and what to do.
    too_big = plans["gpt_one_more"]
    assert too_big.returncode == 1  # a script can tell
    too_big = too_big.stdout
    assert "gpt on v5litepod-8: 8 devices on 1 host(s), 15.75 GiB HBM per device" in too_big
    assert "HBM is what the devices report usable" in too_big
    assert "fits: NO" in too_big and "lower train.batch_size" in too_big
    assert f"largest global batch that fits: {largest:,} ({largest // 8:,} per replica)" in too_big


@pytest.mark.slow
def test_a_dpo_plan_counts_two_sequences_per_pair_and_a_reference_copy_only_without_lora(plans):
    dpo, sft = (json.loads(plans[name].stdout) for name in ("dpo", "sft_same_model"))
    assert dpo["sequences_per_example"] == 2 and sft["sequences_per_example"] == 1
    for key in ("parameters", "optimizer", "gradients"):  # the reference adds no weights
        assert dpo["per_device"][key] == sft["per_device"][key], key
    assert dpo["per_device"]["activations"] > 1.5 * sft["per_device"]["activations"]
    assert dpo["largest_global_batch"] < sft["largest_global_batch"]
    assert "DPO: each example is a pair, 2 sequences" in plans["dpo_text"].stdout
    assert "reference" not in dpo["per_device"]
    # A full fine-tune scores against a frozen copy: one more set of weights, counted.
    full = json.loads(plans["dpo_full"].stdout)["per_device"]
    assert full["reference"] == full["parameters"] > 0
    assert full["total"] == sum(value for key, value in full.items() if key != "total")
    # LoRA under mixed_bfloat16 (a TPU's): the frozen base in bfloat16, half the full fine-tune's
    # float32 weights, and the factors in float32; the plan names them in one line.
    weights, full_weights = (json.loads(plans[name].stdout)["weights"] for name in ("dpo", "dpo_full"))
    assert list(weights["frozen"]) == ["bfloat16"] and list(weights["trainable"]) == ["float32"]
    assert 2 * weights["frozen"]["bfloat16"] == full_weights["trainable"]["float32"]
    assert not full_weights["frozen"]
    assert "weights: frozen bfloat16 " in plans["dpo_text"].stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_one_line(plans, name):
    result = plans[f"bad:{name}"]
    assert_one_line_error(result, *BAD_INPUTS[name][1])


def test_collective_bytes_are_read_from_each_replica_group_form():
    from tpu_keras.planning import compiled_traffic
    hlo = "\n".join([
        # 8 devices in groups of 2 (iota form): an all-gather's result is the whole tensor.
        "  %all-gather = f32[128,256]{1,0} all-gather(%p), channel_id=7, "
        "replica_groups=[4,2]<=[4,2]T(1,0), dimensions={0}",
        # A tuple all-reduce over the mesh's axis_2 (size 2), with an index comment inside.
        "  %all-reduce.1 = (f32[8,128]{1,0}, /*index=1*/bf16[8,128]{1,0}) all-reduce(%a, %b), "
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_2'}, to_apply=%sum",
        # Explicit groups of 4; a reduce-scatter's result is the shard.
        "  %reduce-scatter = f32[16]{0} reduce-scatter(%g), replica_groups={{0,1,2,3},{4,5,6,7}}",
        "  %all-reduce-done = f32[16]{0} all-reduce-done(%start)",  # the pair's second half: not again
    ])
    sent = compiled_traffic.sent_per_device(hlo, devices=8)
    assert sent["all_gather"] == 128 * 256 * 4 // 2
    assert sent["all_reduce"] == 2 * (1 / 2) * (8 * 128 * 4 + 8 * 128 * 2)
    assert sent["reduce_scatter"] == 3 * 16 * 4
    assert sent["total"] == sent["all_gather"] + sent["all_reduce"] + sent["reduce_scatter"]


def test_a_ragged_all_to_all_counts_the_copies_a_device_holds_not_its_buffer():
    """A mixture of experts' exchange: the forward's result and the return's operand are
    buffers of every copy the axis could send one device; what moves is the copies it holds,
    less its own share."""
    from tpu_keras.planning import compiled_traffic
    hlo = "\n".join([
        "  %copies = bf16[4096,1024]{1,0} fusion(%x), kind=kLoop",
        "  %arrived = bf16[32768,1024]{1,0} ragged-all-to-all(%copies, %buffer, %a, %b, %c, %d), "
        "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}",
        "  %products = bf16[32768,1024]{1,0} fusion(%arrived), kind=kLoop",
        "  ROOT %back = bf16[4096,1024]{1,0} ragged-all-to-all(%products, %zeros, %e, %f, %g, %h), "
        "channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}",
    ])
    sent = compiled_traffic.sent_per_device(hlo, devices=8)
    assert sent["all_to_all"] == sent["total"] == 2 * 4096 * 1024 * 2 * 7 / 8
    rows = compiled_traffic.listed(hlo, devices=8)
    assert [(r["op"], r["shape"], r["count"]) for r in rows] == [("ragged-all-to-all", "bf16[4096,1024]", 2)]


def test_collectives_that_span_slices_are_split_hierarchically():
    from tpu_keras.planning import compiled_traffic
    hlo = "\n".join([
        # Groups {0,4},{1,5},...: across the 2 slices of 4 devices only.
        "  %ar.0 = f32[1024]{0} all-reduce(%g), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%sum",
        # Groups of 2 inside a slice: nothing crosses.
        "  %ar.1 = bf16[1024]{0} all-reduce(%h), replica_groups=[4,2]<=[8], to_apply=%sum",
        # Every device: 4 per slice, 2 slices.
        "  %ar.2 = f32[1024]{0} all-reduce(%k), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum",
    ])
    sent = compiled_traffic.sent_per_device(hlo, devices=8, slices=2)
    assert sent["all_reduce_across_slices"] == 2 * (1 / 2) * 4096 + 2 * (1 / 2) * 4096 / 4
    assert sent["all_reduce"] == 2 * (1 / 2) * 2048 + 2 * (3 / 4) * 4096
    # Inside plus across is the flat ring's total.
    flat = compiled_traffic.sent_per_device(hlo, devices=8)
    assert sent["total"] == flat["total"] == sent["all_reduce"] + sent["all_reduce_across_slices"]


def test_an_expert_axis_reduces_the_gradients_it_copies_and_auto_keeps_the_configs():
    from tpu_keras.parallelism import Placement
    from tpu_keras.planning import layout_search, planned_traffic
    mesh = {"data": 2, "fsdp": 1, "expert": 2, "model": 1}
    whole = Placement("attention/kernel", (16, 16), "float32", (None, None), None)
    experts = Placement("experts/gate", (4, 16, 16), "float32", ("expert", None, None), "r")
    sent = planned_traffic.per_step([whole, experts], {whole.path, experts.path}, [], mesh, 1)
    # The whole weight's gradient over all 4 batch splits; each expert shard's over data alone.
    assert sent["gradient_all_reduce"] == round(2 * 3 / 4 * 16 * 16 * 4 + 2 * 1 / 2 * 2 * 16 * 16 * 4)
    assert sent["fsdp_all_gather"] == sent["model_all_reduce"] == 0
    candidates = layout_search.meshes(8, expert=2)
    assert {m["expert"] for m in candidates} == {2} and len(candidates) == 6
    assert all(m["data"] * m["fsdp"] * m["model"] == 4 for m in candidates)
    assert {m["expert"] for m in layout_search.meshes(8)} == {1} and layout_search.meshes(6, 4) == []
    flags = layout_search.flags({"mesh": candidates[0], "remat": "none", "batch_per_replica": 2,
                                 "grad_accum_steps": 1})
    assert flags.startswith("--config.engine=jax ") and "--config.mesh.expert=2" in flags
    assert "--config.train.batch_size=16" in flags  # 2 per split x data 4 x expert 2


# Config errors that train refuses before it runs: plan refuses each in the same line, since
# both start with the one check of a config (tpu_keras.objectives.check).
REFUSED_BY_BOTH = {
    "grpo-completion-fills-the-context": ("configs/grpo_stdlib.py:tiny",
                                          ["--config.grpo.max_completion_length=100000"]),
    "grpo-batch-in-whole-groups": ("configs/grpo_stdlib.py:tiny", ["--config.train.batch_size=9"]),
    "grpo-on-tf": ("configs/grpo_stdlib.py:tiny", ["--config.engine=tf"]),
    "dpo-beta": ("configs/preference_stdlib.py:tiny", ["--config.dpo.beta=-1.0"]),
    "dpo-beta-of-before": ("configs/preference_stdlib.py:tiny", ["--config.train.dpo_beta=0.2"]),
    "objective-without-its-data": ("configs/lm_stdlib.py:tiny", ["--config.train.objective=dpo"]),
    "another-objectives-section": ("configs/lm_stdlib.py:tiny", ["--config.grpo.beta=0.1"]),
    "unknown-key": ("configs/lm_stdlib.py:tiny", ["--config.train.stesp=3"]),
    "interval": ("configs/lm_stdlib.py:tiny", ["--config.train.eval_every=7"]),
}


def test_plan_refuses_what_train_refuses_in_the_same_line(tmp_path):
    planned = run_in_one_process("tpu_keras.plan", {
        name: [f"--config={config}", "--tpu=v5litepod-4", *args]
        for name, (config, args) in REFUSED_BY_BOTH.items()}, timeout=300)
    trained = run_in_one_process("tpu_keras.train", {
        name: [f"--config={config}", f"--workdir={tmp_path / name}", *args]
        for name, (config, args) in REFUSED_BY_BOTH.items()}, timeout=300)
    errors = lambda result: [line for line in (result.stdout + result.stderr).splitlines()
                             if line.startswith("error: ")]
    for name in REFUSED_BY_BOTH:
        assert trained[name].returncode == planned[name].returncode == 2, (name, trained[name])
        assert len(errors(trained[name])) == 1 and errors(trained[name]) == errors(planned[name]), \
            (name, errors(trained[name]), errors(planned[name]))
        assert not (tmp_path / name).exists(), name  # refused before anything was written
