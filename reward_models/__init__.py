"""Reward functions: protocol, loading, combining, built-in rule rewards and a learned scorer."""
