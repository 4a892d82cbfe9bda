"""KV-aware routing: the index of which worker holds which block (`indexer`), and (to come) the cost model
and selection."""
