"""One-off research tools outside the installed package (each writes a record under docs/)."""
