"""convkit: conversions between notations."""
