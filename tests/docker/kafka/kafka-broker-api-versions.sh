#!/bin/sh
# As apache/kafka's script of this name: the broker's API versions, or a non-zero exit when it does not answer.
exec java -Xmx128m -XX:+UseSerialGC -cp '/opt/kafka/libs/*' org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
