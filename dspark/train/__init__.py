"""Training the embedded default pair on a CPU (PyTorch, optional: `pip install torch==2.13.0`).

torch_gdn / torch_model mirror the NumPy models (dspark/models/trunk.py, drafter.py) op for op
and name for name, so that `export` can write weights the NumPy forward runs unchanged. Nothing
else in dspark imports this package, and only the modules named torch_* and the stages import
torch: parity.py, data.py and evaluate.py run without it.

    python -m dspark.train trunk       # next-byte LM on the stdlib corpus (train_trunk.py)
    python -m dspark.train drafter     # DSpark drafter on the trunk's own greedy continuations
    python -m dspark.train calibrate   # refit the confidence head on unseen continuations
    python -m dspark.train export      # weights, configs, parity.npz -> dspark/models/default/
    python -m dspark.train.evaluate    # held-out acceptance through the real session
    python -m dspark.train.record      # RECORD.md from the stage logs
"""
