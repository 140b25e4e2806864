"""Decoder blocks of the supported model families and their weights, in torch.

No sockets, no processes, no asyncio here: this is the compute a device process wraps. What a
checkpoint is (its config, file names, block layouts) is in the torch-free `cakemp.checkpoint`.
"""
