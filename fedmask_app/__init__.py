"""fedmask: how much of update masking's implicit regularization survives federated averaging."""
