"""quantkit convert: the pipeline as named steps, the calibrated per-layer pass, the activation store,
precision decisions, outputs, resume, report and the convert cost estimate.
"""
