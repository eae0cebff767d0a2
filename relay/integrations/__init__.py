"""Drop-ins for the trainers RL teams already run (docs/TRL.md, docs/VERL.md).

Not runtime: each module imports its trainer's packages (transformers, verl) at the top, and nothing
in codec or relay imports this package (tests/test_import_graph.py). Install with the `trl` or
`verl` extra.
"""
