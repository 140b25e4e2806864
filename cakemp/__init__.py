"""cakemp: a multi-GPU worker node for Cake distributed LLM inference."""

__version__ = "0.1.0"
