"""`python -m pgdiag` runs the CLI."""

from pgdiag.cli import main

if __name__ == "__main__":
    main()
