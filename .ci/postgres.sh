#!/usr/bin/env bash
# Start a throwaway PostgreSQL cluster on loopback for the catalog tests and print the URL.
#
#   eval "$(.ci/postgres.sh)"        # installs PostgreSQL if missing, starts it, exports MINT_TEST_POSTGRES_URL
#   .ci/postgres.sh stop             # stops the cluster
#
# Only the `export …` line goes to stdout so `eval` is safe; progress goes to stderr.
# Knobs: MINT_PG_DIR (cluster dir, default /tmp/mint-pg), MINT_PG_PORT (default 55432),
# MINT_PG_DB (default mint_test).
set -euo pipefail

PG_DIR="${MINT_PG_DIR:-/tmp/mint-pg}"
PG_PORT="${MINT_PG_PORT:-55432}"
PG_DB="${MINT_PG_DB:-mint_test}"
log() { echo "postgres.sh: $*" >&2; }

find_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }

if [ -z "$(find_bin)" ]; then
  log "installing PostgreSQL from Debian packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq postgresql >&2
fi
PG_BIN="$(find_bin)"
[ -n "$PG_BIN" ] || { log "no PostgreSQL binaries found after install"; exit 1; }

# initdb and the server refuse to run as root, so as root we act as the `postgres` user
# that the Debian package creates; otherwise we run as ourselves.
if [ "$(id -u)" -eq 0 ]; then
  as_pg() { runuser -u postgres -- "$@"; }
  PG_USER=postgres
else
  as_pg() { "$@"; }
  PG_USER="$(id -un)"
fi

if [ "${1:-start}" = "stop" ]; then
  as_pg "$PG_BIN/pg_ctl" -D "$PG_DIR" -m fast stop >&2 || true
  exit 0
fi

if [ ! -f "$PG_DIR/PG_VERSION" ]; then
  log "creating cluster in $PG_DIR"
  mkdir -p "$PG_DIR"
  [ "$(id -u)" -eq 0 ] && chown postgres: "$PG_DIR"
  # Trust auth is acceptable only because the server listens on loopback and a private socket dir.
  as_pg "$PG_BIN/initdb" -D "$PG_DIR" -U "$PG_USER" -E UTF8 --locale=C.UTF-8 --auth=trust >&2
fi

if ! as_pg "$PG_BIN/pg_ctl" -D "$PG_DIR" status >/dev/null 2>&1; then
  log "starting server on 127.0.0.1:$PG_PORT"
  as_pg "$PG_BIN/pg_ctl" -D "$PG_DIR" -l "$PG_DIR/server.log" -w \
    -o "-p $PG_PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$PG_DIR -c max_connections=200" \
    start >&2
fi

if ! as_pg "$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U "$PG_USER" -d postgres -tAc \
    "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'" | grep -q 1; then
  as_pg "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U "$PG_USER" "$PG_DB"
fi

echo "export MINT_TEST_POSTGRES_URL=postgresql+psycopg://$PG_USER@127.0.0.1:$PG_PORT/$PG_DB"
