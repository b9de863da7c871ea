"""`python -m host.cli`."""

from . import main

main()
