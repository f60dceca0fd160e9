#!/usr/bin/env bash
# Docker for tests/docker on a Debian machine where this runs as root: Debian's docker.io and debootstrap, a Docker
# engine, Compose v2, then the images the tests run (tests/docker/images.py), each made once and cached.
#
#   .ci/docker.sh        set up, and build the images: .ci/run runs it in the background while the other tests run
#
# The engine runs with host networking only (no bridge, no iptables): the test machines have no bridge network and
# the containers reach 127.0.0.1. It is started here only when none answers; its PID goes to $DOCKERD_PID_FILE, so
# that whoever started this stops that engine and no other. Compose v2 is not in Debian (its docker-compose is v1,
# which rejects deploy/docker-compose.yml): it is built from the Go module proxy, once per version, into the cache.
# Whatever fails here leaves the docker tests to skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
COMPOSE_VERSION=${COMPOSE_VERSION:-v2.40.3}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/kinference/docker
DOCKERD_PID_FILE=${DOCKERD_PID_FILE:-$CACHE/dockerd.pid}
mkdir -p "$CACHE"

say() { echo "docker: $*" >&2; }

install_packages() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing ${missing[*]} from Debian"
  timeout 600 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq \
    --no-install-recommends "${missing[@]}" >/dev/null
}

start_engine() {
  docker info >/dev/null 2>&1 && return 0
  say "starting dockerd (host networking only); log: $CACHE/dockerd.log"
  nohup dockerd --bridge=none --iptables=false --ip-masq=false >"$CACHE/dockerd.log" 2>&1 &
  echo $! >"$DOCKERD_PID_FILE"
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && return 0
    kill -0 "$(cat "$DOCKERD_PID_FILE")" 2>/dev/null || { tail -20 "$CACHE/dockerd.log" >&2; return 1; }
    sleep 1
  done
  say "dockerd did not answer within 60 s"; return 1
}

# `go install ...@version` refuses the module (its go.mod has exclude directives); building inside the downloaded
# module works. The Go build cache keeps the compiled packages, the binary is kept under $CACHE by version.
install_compose() {
  docker compose version 2>/dev/null | grep -q " v2\." && return 0
  local binary=$CACHE/compose-$COMPOSE_VERSION/docker-compose
  if [ ! -x "$binary" ]; then
    command -v go >/dev/null || { say "no Go toolchain to build Compose $COMPOSE_VERSION"; return 1; }
    say "building Compose $COMPOSE_VERSION from the Go module proxy (a few minutes, once)"
    local module
    module=$(GOFLAGS=-mod=mod go mod download -json "github.com/docker/compose/v2@$COMPOSE_VERSION" \
      | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
    mkdir -p "$(dirname "$binary")"
    (cd "$module" && CGO_ENABLED=0 timeout 1200 go build -trimpath -o "$binary.part" \
      -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" ./cmd)
    mv "$binary.part" "$binary"
  fi
  mkdir -p "$HOME/.docker/cli-plugins"
  ln -sf "$binary" "$HOME/.docker/cli-plugins/docker-compose"
}

install_packages || { say "docker.io or debootstrap could not be installed: the docker tests will skip"; exit 0; }
start_engine || { say "no Docker engine: the docker tests will skip"; exit 0; }
# Compose (CPU: the Go compiler) beside the images (mostly downloads and disk), each logged as it goes.
install_compose >"$CACHE/compose-build.log" 2>&1 &
compose=$!
make install >/dev/null  # the image builder runs in the venv
SECONDS=0
.venv/bin/python -m tests.docker.images || say "the images could not be built now: the docker tests try again"
say "images ready in $SECONDS s"
wait "$compose" || { tail -20 "$CACHE/compose-build.log" >&2; say "Compose v2 could not be built: the stack test will skip"; }
say "Compose: $(docker compose version 2>&1 | head -1)"
