"""pgdiag's test suite. A regular package, so that `from tests.x import y` finds this folder even where an
installed distribution ships a top-level `tests` package of its own (verl does)."""
