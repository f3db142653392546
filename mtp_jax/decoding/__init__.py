"""The decode engine: one draft-and-verify step (step.py) over the decode state (state.py), the
drafters, draft shapes (shapes.py, tree_verify.py, sampling.py), the device loops (loop.py),
adaptive k (adaptive.py, shape_set.py, tables.py, priors.py, ring.py) and the Engine (engine.py)."""
