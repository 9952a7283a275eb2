"""kopf operator for the ExecutorPool resource."""
