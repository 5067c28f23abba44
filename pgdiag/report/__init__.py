"""Reports (tidy long tables), gates and the status/exit rule, and plots."""
