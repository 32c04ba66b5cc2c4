"""One use case per command: a request in, a result out (no typer, no rich)."""
