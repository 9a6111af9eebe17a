"""What the server does: cohort sampling, the paper's statistics and aggregation.

Only ``strategies.masked_fedavg`` imports flwr; everything else is plain numpy, except
``strategies.device_pass`` (the cohort pass in torch, for updates left on a GPU).
"""
