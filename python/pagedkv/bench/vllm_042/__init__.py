"""vLLM 0.4.2 (the V0-era scheduler API, also 0.5.0's) in the bench: the shared driver of its
engine loop (:mod:`.driver`: the scheduler's configuration and vLLM's single-step output
processing), used by the bench's engines, the tests and the demo's compat path."""
