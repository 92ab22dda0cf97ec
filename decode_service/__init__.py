"""DecodeWorker: an engine in the decode role plus the KV receiver that fills its reservations."""
