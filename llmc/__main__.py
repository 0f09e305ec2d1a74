"""`python -m llmc ...` is the `llmc` command."""
from llmc.cli import main

main()
