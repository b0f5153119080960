"""Will a config fit a slice, and what will it send? Answered before the slice is rented.

The plan's own arithmetic: `layout_report` (where each weight lives on a
mesh, and its bytes per device), `activations` (the activations a backward
pass keeps, from a traced step; `model_split`: what the model axis splits
of them), `planned_traffic` (the bytes a layout sends per update, from the
traced matmuls), `network` (those bytes over the chip interconnect and the
data-center network, and their time). `slice_plan` puts them together
for one config and slice (`python -m tpu_keras.plan`), `layout_search`
tries every mesh and remat setting (`--auto`), `user_plan` plans a model
built in the user's code (`tpu_keras.plan_model`).

The compilers' answers, to check the plan against: `tpu_compiler` (the
TPU's own, through libtpu, for a slice this machine lacks, nothing
allocated) and `compiled_step` (XLA:CPU on fake devices), read through
`compiled_traffic` (each collective of a compiled program, its bytes and
network). `jaxpr_walk` is the traversal the traced-step modules share.

Nothing here runs in a training run: a run measures itself with
`measurement` (FLOPs, the peak, timings).
"""
