"""Study B's results: its tables (the comparison with `muon`, its claims), its figures and its part of the
report."""
