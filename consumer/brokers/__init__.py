"""Local brokers on a loopback port, for tests, benchmarks and ``make demo``: ``broker`` (the embedded Tansu, and
the choice between brokers), ``apache_kafka`` (Apache Kafka from Maven Central's jars) and ``ports`` (a free port
for either)."""
