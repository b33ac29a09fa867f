"""Process-level services every stage may use: torchrun collectives, crash points, progress, machine probes,
the device a command runs on (device), the atomic file write and the cache folder (files), byte counts
for people (units).
Imports nothing of quantkit but errors; nothing here knows what a model is.
"""
