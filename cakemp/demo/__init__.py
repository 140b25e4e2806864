"""`cakemp demo` and its scaffolding: a synthetic checkpoint, a trained toy tokenizer, a local node."""
