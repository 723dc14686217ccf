"""python -m flashlab.bench: see flashlab.bench."""

from flashlab.bench.cli import main

main()
