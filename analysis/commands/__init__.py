"""The analysis commands, one module per kind of work; `analysis.cli` declares their arguments."""
