"""``kvgate produce FILE.jsonl``: send requests to any Kafka (see ``client_cli``)."""

from kvgate.admission_service.client_cli import add_produce_arguments as add_arguments
from kvgate.admission_service.client_cli import run_produce as run

__all__ = ["add_arguments", "run"]
