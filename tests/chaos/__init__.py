"""The chaos suite: many injected faults, a recorded history, invariants checked from the
history alone, and a negative control per scenario showing the check can fail.

``scripts/chaos`` runs the full scale and prints the table (``tests.chaos.report``);
the suite's default run (CI) runs the short scale of every scenario. See
docs/reliability.md.
"""
