"""Calibration of the learned scorer: KVzip+ targets on a corpus that ships with Python, per-layer fits."""
