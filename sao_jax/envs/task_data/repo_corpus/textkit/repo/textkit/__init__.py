"""textkit: small string utilities."""
