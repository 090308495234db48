"""numkit: small statistics on lists of numbers."""
