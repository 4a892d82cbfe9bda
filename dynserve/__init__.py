"""dynserve: a distributed LLM-serving layer with a built-in paged-attention engine."""

__version__ = "0.1.0"
