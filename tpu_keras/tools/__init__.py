"""The reports behind `python -m tpu_keras.info` and the sampler behind `.generate`.

`cluster_info`: what `connect` finds here. `slice_layout`: how a run's mesh
lies on a TPU slice, host by host (`info --tpu`). `sampling`: a run's model
or a keras-hub preset, with its tokenizer, generating text. The planner
(`.plan`, `.layout`, `tpu_keras.plan_model`) is its own package, `planning`.
"""
