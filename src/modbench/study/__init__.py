"""Studies: specs, the runner and its results store (see docs/studies.md)."""
