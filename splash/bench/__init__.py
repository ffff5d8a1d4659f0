"""`splash-bench`: SPLASH's benchmark commands (subcommands in `splash.bench.cli.SUBCOMMANDS`)."""
