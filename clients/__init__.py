"""What a client does: local training, update masking and seed derivation (pure torch/numpy)."""
