"""Code that only the examples under examples/ use (nothing in the training path imports it)."""
