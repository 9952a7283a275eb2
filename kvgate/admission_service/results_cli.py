"""``kvgate results``: print results from any Kafka as JSON lines (see ``client_cli``)."""

from kvgate.admission_service.client_cli import add_results_arguments as add_arguments
from kvgate.admission_service.client_cli import run_results as run

__all__ = ["add_arguments", "run"]
