"""What a model is, without any weights: the architecture dataclass and presets, tensor classes, the
reference decoder layers as pure functions, the FP8 KV-cache simulation and the tensor inventory.
"""
