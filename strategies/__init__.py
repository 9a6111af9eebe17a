"""What the server does: cohort sampling, the paper's statistics and aggregation.

Only ``strategies.masked_fedavg`` imports flwr; everything else is plain numpy.
"""
