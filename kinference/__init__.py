"""kinference: Kafka-native streaming inference.

The import package maps the repository's top-level folders (see pyproject.toml):
``kinference.consumer`` is the service, ``kinference.handlers`` the model handlers and their contract,
``kinference.loadgen`` the request-reply client and the load generator.
"""
