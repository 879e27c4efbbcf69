"""Checkpoints and export: crash-safe checkpoint folders and exact resume, durable files, the trainable
weights of a live model, the ``best`` pointer, exported adapters or merged models, and pushes to the Hub."""
