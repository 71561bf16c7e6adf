"""Shared pytest setup: fixtures for the real Kafka broker live in tests/kafka_broker.py."""

pytest_plugins = ["tests.kafka_broker"]
