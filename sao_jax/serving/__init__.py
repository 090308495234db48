"""The OpenAI-compatible endpoint: routes, requests and replies, sessions, the batcher.

Above `rollout` (it samples with the rollout engine and backends), below
`train` (docs/DESIGN.md, "Layers"); launch/serve.py starts it.
"""
