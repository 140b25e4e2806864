"""What a checkpoint is, without torch: its files, its config and the block layouts it implies.

The front (setup, admission), the master and the torch loader all read these facts; nothing
here imports torch, so the front can know the model without loading it.
"""
