"""The partitioner: Flax model → 4D layouts and pipeline stages → immutable Plan.

Pure: it needs no devices and never mutates the user's model.
"""
