"""Checkpoints: saving and loading them, one file or each trainer's shards, written durably."""
