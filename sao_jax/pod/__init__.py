"""A pod: its programs compiled for its chips ahead of time, and its hosts started and supervised.

The top layer (docs/DESIGN.md, "Layers"). `aot` compiles a config's
programs for a TPU topology on a CPU host and says whether they fit
(`chips`, `aot_programs`, `lowering`, `fit`: launch/compile.py); the plan,
Ray and the Kubernetes JobSet turn a config into the commands each host
runs and watch them.
"""
