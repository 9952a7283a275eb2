#!/bin/sh
# Start a single-node KRaft broker+controller from the configuration in $KAFKA_SERVER_PROPERTIES.
# The log directory (log.dirs) is formatted only when it holds no meta.properties yet, so a
# restarted container, or a new one on the same volume, keeps its data and cluster id.
set -eu

: "${KAFKA_SERVER_PROPERTIES:?the broker configuration is passed in KAFKA_SERVER_PROPERTIES}"
config=/opt/kafka/config/server.properties
classpath='/opt/kafka/libs/*'
logging=-Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties
# The format tool runs for a second or two: C1 alone compiles all it needs.
tool_jit=-XX:TieredStopAtLevel=1

printf '%s\n' "$KAFKA_SERVER_PROPERTIES" > "$config"
log_dir=$(sed -n 's/^log\.dirs=//p' "$config")
if [ -z "$log_dir" ]; then
  echo "entrypoint: log.dirs is missing from KAFKA_SERVER_PROPERTIES" >&2
  exit 2
fi

if [ ! -f "$log_dir/meta.properties" ]; then
  mkdir -p "$log_dir"
  cluster_id=$(java "$tool_jit" "$logging" -cp "$classpath" kafka.tools.StorageTool random-uuid)
  java "$tool_jit" "$logging" -cp "$classpath" kafka.tools.StorageTool format --standalone \
    -t "$cluster_id" -c "$config"
fi

# exec: the JVM becomes PID 1 and receives `docker stop`'s SIGTERM for a clean shutdown.
# C1-only JIT (TieredStopAtLevel=1): on a busy 2-core machine the broker is ready about a third
# sooner, and a test broker never runs long enough to need C2's peak throughput.
# shellcheck disable=SC2086  # KAFKA_JVM_OPTS holds several JVM flags
exec java ${KAFKA_JVM_OPTS:--Xms256m -Xmx1g -XX:TieredStopAtLevel=1} \
  -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true "$logging" \
  -cp "$classpath" kafka.Kafka "$config"
