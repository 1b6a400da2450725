"""Study A's results: its tables, the claims of the seed as tests against nulls, its figures and its part
of the report."""
