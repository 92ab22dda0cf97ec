"""One module per `pdserve` subcommand (see pdserve/cli.py)."""
