"""Decoder blocks of the supported model families, their config and their weights.

No sockets, no processes, no asyncio here: this is the compute a device process wraps.
"""
