"""Executors: run a scheduled step, for real (``torch``) or on a cost model (``simulated``)."""
