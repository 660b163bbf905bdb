"""One module per `r3trace` subcommand: HELP, add_arguments(parser), run(args) -> int (see r3trace/cli.py)."""
