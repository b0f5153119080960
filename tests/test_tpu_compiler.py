"""`python -m tpu_keras.plan --measure` on the TPU compiler: libtpu compiles the toolkit's real
training step for a slice this CPU-only machine does not have, with nothing allocated.

The calls share one process (a start of JAX, Keras and libtpu): the TPU
compiler's path fakes no CPU devices, so nothing fixes the process to one slice.
"""

import json
import subprocess
import sys

import pytest

from conftest import assert_one_line_error, run_command, run_in_one_process
from tpu_keras.planning import reports, tpu_compiler

LM = ["--config=configs/lm_stdlib.py", "--config.engine=jax"]


@pytest.fixture(scope="module")
def compiled():
    calls = run_in_one_process("tpu_keras.plan", {
        # The acceptance command.
        "v5litepod_16": LM + ["--tpu=v5litepod-16", "--measure", "--json"],
        "two_slices": LM + ["--tpu=2xv5litepod-16", "--config.mesh.fsdp=2",
                            "--config.mesh.model=2", "--measure", "--json"],
        "out_of_memory": LM + ["--tpu=v5e-1", "--config.model.width=16384", "--config.model.depth=1",
                               "--measure"],
        "auto": LM + ["--tpu=v5litepod-8", "--auto", "--measure", "--compiled=2", "--json"],
        "unknown_type": LM + ["--tpu=v9-8", "--measure"],
        # keras-hub's Llama at 512 tokens: its attention as the TPU's fused kernel.
        "llama_splash": ["--config=configs/llama_stdlib.py", "--config.engine=jax",
                         "--config.model.context_length=512", "--tpu=v5litepod-8", "--measure",
                         "--json"],
        # GRPO's step (the group model) on a mesh that splits the weights: LoRA, whose
        # reference is the base, and a full fine-tune, which holds a frozen copy.
        "grpo_lora": ["--config=configs/grpo_stdlib.py", "--tpu=v5litepod-4", "--measure", "--json"],
        "grpo_full": ["--config=configs/grpo_stdlib.py", "--tpu=v5litepod-4", "--measure", "--json",
                      "--config.model.lora_rank=0"],
        "grpo_full_beta_0": ["--config=configs/grpo_stdlib.py", "--tpu=v5litepod-4", "--measure",
                             "--json", "--config.model.lora_rank=0", "--config.grpo.beta=0"],
        # A keras-hub task with neither a preset nor its architecture.
        "no_architecture": ["--config=configs/finetune.py", "--tpu=v5litepod-8"],
    }, timeout=600)
    # The text a plan prints is format_plan of its JSON: rendered here, not compiled twice.
    for name in ("two_slices", "llama_splash"):
        printed = reports.format_plan(json.loads(calls[name].stdout))
        calls[f"{name}_text"] = subprocess.CompletedProcess([], 0, printed + "\n", "")
    return calls


@pytest.mark.slow
def test_plan_measure_asks_the_tpu_compiler_for_v5litepod_16(compiled):
    result = compiled["v5litepod_16"]
    assert result.returncode == 0, result.stderr[-3000:]
    p = json.loads(result.stdout)
    m = p["measured"]
    assert m["backend"] == "tpu" and m["compiler"].startswith("TPU compiler (libtpu 0.0.")
    assert m["devices"] == 16 and m["topology"] == "v5e:4x4" and m["slices"] == 1
    assert p["precision"] == "mixed_bfloat16"
    # Per device: the compiler's buffers, their sum, and the peak against the chip's HBM.
    assert m["arguments"] > 0 and m["temporaries"] > 0 and m["program"] > 0
    assert m["peak"] == m["arguments"] + m["outputs"] + m["temporaries"] + m["program"]
    assert m["hbm_bytes_per_device"] == p["hbm_bytes_per_device"] and m["fits"] and p["fits"]
    # The weights and optimizer state the plan counts exactly are the compiler's arguments
    # (less the batch and the metrics' few scalars), within 1%.
    state = p["per_device"]["parameters"] + p["per_device"]["optimizer"]
    assert abs(m["arguments"] / state - 1) < 0.01, (m, p["per_device"])
    # Data parallel over 16 chips: the gradients' all-reduce is all it sends, as planned.
    assert {c["op"] for c in m["collectives"]} == {"all-reduce"}
    assert all(c["network"] == "ICI" and c["group_size"] == 16 for c in m["collectives"])
    assert m["sent_per_step"]["total"] == sum(c["sent_bytes"] for c in m["collectives"])
    assert abs(p["sent_per_step"]["total"] / m["sent_per_step"]["total"] - 1) < 0.02
    # The compiler's own step-time estimate, and the MFU it implies.
    assert 0 < m["step_seconds"] < 1 and 0 < m["mfu"] < 1 and m["estimate_covers"] == "the step"


@pytest.mark.slow
def test_two_slices_send_across_the_data_center_network(compiled):
    result = compiled["two_slices"]
    assert result.returncode == 0, result.stderr[-3000:]
    p = json.loads(result.stdout)
    m = p["measured"]
    assert m["devices"] == 32 and m["slices"] == 2 and m["topology"] == "v5e:4x4"
    networks = {c["network"] for c in m["collectives"]}
    assert networks == {"ICI", "DCN"}, networks
    # Only the gradients' all-reduce crosses slices: what libtpu hands the megascale runtime.
    across = [c for c in m["collectives"] if c["network"] == "DCN"]
    assert {c["op"] for c in across} == {"all-reduce"} and all(c["group_size"] == 2 for c in across)
    assert m["sent_per_step"]["all_reduce_across_slices"] == sum(c["dcn_bytes"] for c in across) > 0
    # fsdp and model split weights inside a slice: gathers and reduce-scatters over ICI.
    assert {"all-gather", "reduce-scatter"} <= {c["op"] for c in m["collectives"]}
    text = compiled["two_slices_text"].stdout
    assert "TPU compiler (libtpu " in text and "(v5e:4x4 x 2 slices)" in text
    assert "over the data-center network (DCN)" in text and "fits by the TPU compiler: yes" in text


@pytest.mark.slow
def test_a_step_the_compiler_cannot_fit_does_not_fit(compiled):
    result = compiled["out_of_memory"]
    assert result.returncode == 1, (result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stdout + result.stderr
    assert "does not fit: RESOURCE_EXHAUSTED" in result.stdout
    assert "fits by the TPU compiler: NO" in result.stdout and "of 15.75 GiB HBM" in result.stdout


@pytest.mark.slow
def test_auto_with_measure_lets_the_compiler_choose_among_the_best_planned(compiled):
    result = compiled["auto"]
    assert result.returncode == 0, result.stderr[-3000:]
    s = json.loads(result.stdout)
    rows = s["compiled"]  # the two best-planned layouts, plan and compiler side by side
    assert len(rows) == 2 and [row["chosen"] for row in rows].count(True) == 1, rows
    assert rows[0]["mesh"] == s["plan_recommended"]["mesh"]
    assert all(row["fits"] and row["peak"] > 0 and row["step_seconds"] > 0 for row in rows), rows
    chosen = next(row for row in rows if row["chosen"])
    assert chosen["step_seconds"] == min(row["step_seconds"] for row in rows)
    assert s["chosen_by"] == "the compiler's step-time estimate"
    best = s["recommended"]
    assert (best["mesh"], best["remat"]) == (chosen["mesh"], chosen["remat"])
    assert s["measured"]["topology"] == "v5e:2x4" and s["measured"]["peak"] == chosen["peak"]
    text = reports.format_search(s)  # what the command prints without --json
    assert "best-planned layouts, compiled by the TPU compiler (libtpu " in text
    assert "<- chosen" in text
    assert "the compiler's step-time estimate, the best of the 2 best-planned layouts compiled" in text


@pytest.mark.slow
def test_measure_for_a_tpu_type_nothing_describes_is_one_error_line(compiled):
    assert_one_line_error(compiled["unknown_type"], "unknown TPU slice 'v9-8'")
    assert compiled["unknown_type"].returncode == 2


@pytest.mark.slow
def test_a_hub_model_without_preset_or_architecture_is_one_error_line(compiled):
    assert_one_line_error(compiled["no_architecture"], "has no model.preset",
                          "model.vocabulary_size, model.num_layers")
    assert compiled["no_architecture"].returncode == 2


def test_a_generation_libtpu_does_not_know_is_one_error_line():
    # A table entry an older libtpu does not know: the v5litepod-8 of a generation 'v9'.
    result = run_command([sys.executable, "-c", (
        "import dataclasses\n"
        "from tpu_keras import cli\n"
        "from tpu_keras.cluster import libtpu, topology\n"
        "found = topology.parse_slice('v5litepod-8')\n"
        "later = dataclasses.replace(found, generation=dataclasses.replace(found.generation, name='v9'))\n"
        "cli.start(lambda argv: libtpu.slice_devices(1, later))\n")],
        env={"JAX_PLATFORMS": "cpu"}, check=False)
    assert_one_line_error(result, "libtpu cannot describe v5litepod-8 as v9:2x4", "TPU v9")
    assert result.returncode == 2


@pytest.mark.slow
def test_keras_hubs_llama_attention_compiles_to_the_tpus_fused_kernel(compiled):
    """Three kernel calls per layer (forward, and the two of its gradient) in the TPU program;
    docs/performance.md compares Keras's own attention, which never reaches the kernel."""
    result = compiled["llama_splash"]
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads(result.stdout)["measured"]
    assert m["splash_attention_layers"] == 2 and m["fused_kernels"] == 6, m
    # The gpt (Keras's MultiHeadAttention) is not routed: no kernel in its program.
    assert json.loads(compiled["v5litepod_16"].stdout)["measured"]["fused_kernels"] == 0


@pytest.mark.slow
def test_where_plan_and_compiler_part_the_output_names_the_term_and_why(compiled):
    p = json.loads(compiled["llama_splash"].stdout)
    m = p["measured"]
    by_term = tpu_compiler.terms(p, m)
    # The plan keeps every activation alive at once; the compiler also recomputes some in the
    # backward pass and frees what it kept as the gradients appear.
    assert p["per_device"]["total"] > 1.1 * m["peak"], (p["per_device"], m)
    assert by_term["differs_most"] == "gradients and activations", by_term
    assert by_term["gradients and activations"]["compiler"] == m["temporaries"]
    text = compiled["llama_splash_text"].stdout
    assert "the plan against the compiler, term by term:" in text, text[-3000:]
    assert "differs most: gradients and activations: the plan counts each tensor" in text
    # Where they agree within 10%, no such lines (lm_stdlib on a v5litepod-16: 0.78 here).
    lm = json.loads(compiled["v5litepod_16"].stdout)
    assert ("differs_most" in tpu_compiler.terms(lm, lm["measured"])) == (
        abs(lm["per_device"]["total"] / lm["measured"]["peak"] - 1) > tpu_compiler.MEMORY_BOUND)


@pytest.mark.slow
def test_the_activation_estimate_is_held_to_the_compiler(compiled):
    """keras-hub's Llama at 512 tokens, where activations are most of the plan: within 1.6 of
    the TPU compiler's peak from above (1.54 here). Counted as autodiff lists them (one
    tensor once per backward rule that needs it, the causal mask, softmax's output beside
    its exponentials, and the scores the fused kernel never writes) it was 6.4."""
    p = json.loads(compiled["llama_splash"].stdout)
    d, m = p["per_device"], p["measured"]
    assert d["activations"] > 0.8 * d["total"], d
    assert 1.0 <= d["total"] / m["peak"] <= 1.6, (d, m)


@pytest.mark.slow
def test_where_the_bytes_sent_part_the_output_names_the_collective_and_why(compiled):
    """Across two slices the plan counts 6-15% less than the compiled transfers; the kinds
    are set side by side, and the line appears exactly when the totals part by over 15%."""
    for name, text_name in (("two_slices", "two_slices_text"), ("llama_splash", "llama_splash_text")):
        p = json.loads(compiled[name].stdout)
        by_kind = tpu_compiler.sent_terms(p, p["measured"])
        assert sum(k["compiler"] for kind, k in by_kind.items() if kind != "differs_most") == \
            p["measured"]["sent_per_step"]["total"], by_kind
        parted = abs(p["sent_per_step"]["total"] / p["measured"]["sent_per_step"]["total"] - 1) > 0.15
        assert ("differs_most" in by_kind) == parted
        assert ("    differs most: all" in compiled[text_name].stdout
                or "    differs most: collective" in compiled[text_name].stdout) == parted


def test_nothing_sent_on_either_side_names_no_differing_collective():
    """One device: the plan and the compiler both send 0 bytes, and agree."""
    nothing = {"total": 0}
    assert "differs_most" not in tpu_compiler.sent_terms({"sent_per_step": nothing},
                                                         {"sent_per_step": nothing})
    assert "differs_most" in tpu_compiler.sent_terms({"sent_per_step": {"total": 8, "model_all_reduce": 8}},
                                                     {"sent_per_step": {"total": 0}})


@pytest.mark.slow
def test_a_grpo_plan_counts_the_sampler_and_a_copy_only_without_lora_and_compiles_the_group_step(
        compiled):
    lora, full, alone = (json.loads(compiled[name].stdout)
                         for name in ("grpo_lora", "grpo_full", "grpo_full_beta_0"))
    assert lora["num_generations"] == 8 and "reference" not in lora["per_device"]
    # 32 completions per replica, 2 layers, key and value, 16 positions, 2 heads over
    # model=2, 16 per head, bf16; and one step's logits, 32 x 256 float32.
    assert lora["per_device"]["sampling"] == 32 * 2 * 2 * 16 * 1 * 16 * 2 + 32 * 256 * 4
    assert full["per_device"]["reference"] == full["per_device"]["parameters"] > 0
    assert full["per_device"]["total"] >= full["per_device"]["parameters"] * 2
    assert lora["measured"]["fits"] and full["measured"]["fits"], (lora["measured"], full["measured"])
    # The sampling program is compiled for the slice too, and holds at least the plan's cache.
    assert lora["measured"]["sampling"]["fits"]
    assert lora["measured"]["sampling"]["temporaries"] >= lora["per_device"]["sampling"]
    assert "GRPO's sampling program, compiled too" in reports.format_plan(lora)
    assert "GRPO: each step trains on 64 completions" in reports.format_plan(lora)
    # The frozen copy is an argument of the compiled step with beta > 0 alone (the compiler
    # pads small weights to its tiles, so at least the plan's bytes).
    assert "reference" not in alone["per_device"]
    assert full["measured"]["arguments"] - alone["measured"]["arguments"] >= \
        full["per_device"]["reference"]
