"""``python -m worker.cli``: what the supervisor runs for each child."""

from worker.cli.main import main

main()
