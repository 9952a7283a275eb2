"""``kvgate gateway``: an OpenAI-compatible HTTP door over Kafka (docs/gateway.md)."""
