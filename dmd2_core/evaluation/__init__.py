"""Weight-free quality signals for any model (the compute core)."""
