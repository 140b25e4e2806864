"""Device processes: one per GPU (or CPU slot), each holding its layers and per-session KV caches."""
