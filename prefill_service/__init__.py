"""PrefillWorker: an engine in the prefill role plus the KV sender that pushes to decode workers."""
