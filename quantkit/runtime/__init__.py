"""Process-level services every stage may use: torchrun collectives, crash points, progress, machine probes.
Imports nothing of quantkit but errors; nothing here knows what a model is.
"""
