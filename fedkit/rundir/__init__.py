"""What a run leaves on disk: atomic files, logs, checkpoints, client memories, the lock."""
