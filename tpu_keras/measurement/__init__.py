"""What a run measures about itself: model FLOPs, the peak they are compared with,
activation memory, and where its wall time goes.

Each module is imported on its own; this package imports nothing heavy.
"""
