"""The codec's lab: measuring instruments for `deltarelay bench`, not part of the runtime.

- `codec.lab.baselines`: reimplementations of the published checkpoint-delta formats (the anchors).
- `codec.lab.bound`: the conditional entropy bound of a BF16 delta.
- `codec.lab.perfmap`: names for the compiled kernels in `perf` profiles (`scripts/profile_kernels.py`).

Nothing under codec/ outside this package imports it (tests/test_import_graph.py checks), and it
uses only the codec's public API (see `codec`'s docstring).
"""
