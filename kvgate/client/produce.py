"""``kvgate produce FILE.jsonl``: send requests to any Kafka (see ``commands``)."""

from kvgate.client.commands import add_produce_arguments as add_arguments
from kvgate.client.commands import run_produce as run

__all__ = ["add_arguments", "run"]
