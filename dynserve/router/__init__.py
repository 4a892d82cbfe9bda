"""KV-aware routing: the index of which worker holds which block (`indexer`), the approximate router's memory
of where it sent prompts (`approx`), the cost model, hot-spot guard and pick as pure functions (`cost`), and
the `Router` shell that ties them to the gateway and the event plane (`router`)."""
