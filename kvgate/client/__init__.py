"""Kafka client commands for any cluster: ``kvgate produce`` and ``kvgate results``."""
