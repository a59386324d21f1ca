"""The federation runtime: server, workers, messages, executors, aggregation, ledger,
evaluation, and the engine that runs rounds."""
