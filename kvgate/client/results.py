"""``kvgate results``: print results from any Kafka as JSON lines (see ``commands``)."""

from kvgate.client.commands import add_results_arguments as add_arguments
from kvgate.client.commands import run_results as run

__all__ = ["add_arguments", "run"]
