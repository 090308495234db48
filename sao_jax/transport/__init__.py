"""The fleet's transport: shards and weight versions between hosts, the weight channel.

Above `data` (files, stores, identities), below `envs` and everything that
runs (docs/DESIGN.md, "Layers").
"""
