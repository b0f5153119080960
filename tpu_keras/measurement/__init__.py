"""What a run measures about itself: model FLOPs, the peak they are compared with, and
where its wall time goes. (What a plan estimates before a run is `planning`'s.)

Each module is imported on its own; this package imports nothing heavy.
"""
