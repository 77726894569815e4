"""Continuous batching over BatchedSequenceCache: scheduler, sampling, graph runner, engine."""
