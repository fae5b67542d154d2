"""The tracker: exact bytes of the tensor storages that ATen ops create, for machines without a GPU.

`ledger` counts the storages (no torch); `mode` is the dispatch mode that tells it of each op's outputs;
`patches` covers what the mode does not see; `backend` puts them together as `TrackerBackend`; `shadow`
runs them beside another backend to explain its peaks; `recording` and `attribution` say where each
storage came from and what it is for, reading the autograd graph through `graph`; `gpu_paths` takes a
GPU's code paths on the CPU or meta; `meta_errors` says in one line why a test cannot run on meta.
"""
