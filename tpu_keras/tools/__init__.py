"""The reports behind `python -m tpu_keras.info`, `.layout` and `.plan`.

`cluster_info`: what `connect` finds here. `layout_report`: where every
weight of a config's model lives on its mesh, and the bytes per device.
`memory_plan`: whether a config fits a TPU slice, before paying for it;
`user_plan`: the same for a model built in the user's code
(`tpu_keras.plan_model`). They build on every other package, and nothing
but the command lines and `tpu_keras.plan_model` imports them.
"""
