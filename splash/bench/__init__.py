"""`splash-bench`: fixed-layout sweeps, regression compare between results, plots, and the benchmark commands.

Subcommands live in their own modules (see `splash.bench.cli.SUBCOMMANDS`); the JSON result format and the
environment description are in `splash.bench.results`, the rich tables in `splash.bench.tables`."""
