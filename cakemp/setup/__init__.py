"""Zero-config setup: discovery replies, the setup exchange with a master, and Cake's model cache.

Used by the front before it serves (and for discovery, while it serves); never imports torch.
"""
