"""The `ember bench` commands, one module each: NAME, HELP, add_cli_args(parser) and main(args) (vLLM's
benchmarks/latency.py shape), PARSER where its --help has a description. bench/cli.py lists them in
COMMANDS. A command imports the library (bench/lib/), the sides and the peers; none of those imports a command.
"""
