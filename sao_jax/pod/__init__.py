"""Starting and supervising a pod's hosts: the plan, Ray, Kubernetes JobSet.

The top layer (docs/DESIGN.md, "Layers"): it turns a config into the
commands each host runs and watches them.
"""
