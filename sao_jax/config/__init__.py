"""The run's typed configuration: `sections.Sections`, one frozen record a section.

Above `algo` and `models` (it names their registries and presets), below
everything that runs (docs/DESIGN.md, "Layers").
"""
