"""What a user may pass: model specs (folder, hf://, tiny:, realshape:) resolved to a Checkpoint, and
data specs resolved to calibration/evaluation token ids.
"""
