"""CLI glue: one typer command per DVC stage."""
