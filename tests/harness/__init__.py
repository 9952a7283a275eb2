"""Test-support code for kvgate's integration tests: a Docker engine, a registry-free Apache
Kafka 4.4 image, and broker handles with fault injection. See docs/testing.md.

Modules: ``system`` (cache, locks, logged commands, apt), ``docker_engine``, ``kafka_image``
(+ the ``kafka_recipe/`` files), ``kafka`` (broker handles), ``kafka_client`` (readiness, topics),
``tls`` (a throw-away certificate). ``python -m tests.harness prepare|status|clean`` manages
the cache.
"""
