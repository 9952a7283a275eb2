"""Admission service: consumes requests, schedules steps on executors, produces results."""
