"""The compute every side runs: loaded blocks over per-session state, and tensors to wire bytes.

The device process serves it over ipc; the master (`cakemp generate`), the demo and the
benchmarks call it in-process. It owns no process and no socket.
"""
