"""seqkit: helpers for lists."""
