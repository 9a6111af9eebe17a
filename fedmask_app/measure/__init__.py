"""Curvature measurements of one round (torch, numpy and the standard library only): the
Hessian-weighted recovery ρ_H and the direct masking penalties (``curvature``), and the top
Hessian eigenvalue and Hessian trace of the loss (``flatness``)."""
