"""Experiments: the paper's findings in miniature, one module per finding (see runner.py)."""
