"""Telemetry: OpenTelemetry attribute names and SDK setup for entry points."""
