"""What the mixture-of-experts families share: their experts' layout rules, and the
transformers names of their weights (each expert a module of its own, as transformers 5's
save_pretrained writes the Hub's checkpoints).

keras-hub keeps each block's experts stacked, E first: gate and up (E, H, F),
or fused (E, H, 2F), and the output (E, F, H). transformers names expert e's
projections `...experts.{e}.{gate,up,down}_proj.weight` (Mixtral's `w1`,
`w3`, `w2`), each (out, in).
"""

# Imported inside functions: keras (optional to import here: only exports need it).
from tpu_keras.models.expert_lora import ExpertTarget
from tpu_keras.parallelism import Rule, replicated


def rules(router: str, gate_up: list, down: str, biases: list = ()) -> list[Rule]:
    """Experts over `expert`, on their first dimension; their units over `model` where the
    units are a dimension of their own (`gate_up`: (pattern, axes) pairs); the output
    (E, F, H) over `expert` and `model`; the router (H, E) whole: small, and every device
    routes its own tokens."""
    found = [replicated(router)]
    found += [Rule(pattern, axes) for pattern, axes in gate_up]
    found.append(Rule(down, ("expert", "model", None)))
    found += [Rule(pattern, axes) for pattern, axes in biases]
    return found


def without_dense_mlp(found: list[Rule]) -> list[Rule]:
    """A dense family's rules without those of its MLP's kernels (Llama's paths), which an
    MoE block replaces: a rule that matches no weight is refused."""
    return [rule for rule in found if not ("feedforward_" in rule.pattern and "_dense/kernel" in rule.pattern)]


def outer_weights(backbone, include_lm_head: bool) -> dict:
    """The token embedding, the final norm and, where it is not tied to the embedding, the
    output head, under transformers' names."""
    from keras import ops
    embedding = backbone.get_layer("token_embedding")
    weights = {"model.embed_tokens.weight": embedding.embeddings,
               "model.norm.weight": backbone.get_layer("sequence_output_layernorm").scale}
    if include_lm_head and not getattr(backbone, "tie_word_embeddings", False):
        weights["lm_head.weight"] = ops.transpose(embedding.reverse_embeddings)
    return weights


def attention_weights(backbone, i: int, attention, names=("_query_dense", "_key_dense",
                      "_value_dense", "_output_dense")) -> dict:
    """Layer i's query, key, value and output kernels (`attention`'s attributes `names`) under
    transformers' names, (out, in); Keras's query (H, heads, K) and output (heads, K, H)."""
    from keras import ops
    hidden = backbone.hidden_dim
    query, key, value, output = (getattr(attention, name) for name in names)
    return {f"model.layers.{i}.self_attn.{name}.weight": ops.transpose(ops.reshape(layer.kernel, shape))
            for name, layer, shape in (("q_proj", query, (hidden, -1)), ("k_proj", key, (hidden, -1)),
                                       ("v_proj", value, (hidden, -1)), ("o_proj", output, (-1, hidden)))}


def per_expert(stacked, name: str) -> dict:
    """{name.format(e): expert e's (in, out) kernel transposed to transformers' (out, in)}."""
    from keras import ops
    return {name.format(e): ops.transpose(stacked[e]) for e in range(stacked.shape[0])}


def fused_bank_weights(bank, prefix: str) -> dict:
    """Qwen's expert bank (gate and up fused along the units, the gate first; the output) as
    transformers 5 writes it, each expert's `{prefix}.experts.{e}.{gate,up,down}_proj.weight`."""
    gate_up = bank._expert_feedforward_gate_dense
    units = gate_up.shape[-1] // 2
    return {**per_expert(gate_up[..., :units], f"{prefix}.experts.{{}}.gate_proj.weight"),
            **per_expert(gate_up[..., units:], f"{prefix}.experts.{{}}.up_proj.weight"),
            **per_expert(bank._expert_feedforward_output_dense, f"{prefix}.experts.{{}}.down_proj.weight")}


def fused_bank_targets(block: str) -> tuple:
    """PEFT's `target_parameters` on a fused bank (Qwen3-MoE's, Qwen 3.5's: gate and up
    (E, H, 2F), the gate first, the output (E, F, H)) under the block layer `block`:
    transformers 5 holds them as `mlp.experts.gate_up_proj` (E, 2F, H), the gate first, and
    `down_proj` (E, H, F), the same weights transposed."""
    return tuple(ExpertTarget(f"mlp.experts.{name}", f"{block}/experts", "model.layers.{i}.mlp.experts",
                              variable=variable, attribute=f"_{variable}")
                 for name, variable in (("gate_up_proj", "expert_feedforward_gate_dense"),
                                        ("down_proj", "expert_feedforward_output_dense")))
