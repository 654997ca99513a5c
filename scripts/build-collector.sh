#!/usr/bin/env bash
# Build otelcol-otelprof from collector-config/builder-config.yaml with the OpenTelemetry
# Collector Builder, caching the binary under a name keyed by the manifest's hash so that it
# is rebuilt only when the manifest changes.
#
#   scripts/build-collector.sh [MANIFEST]
#
# Environment:
#   OTELPROF_CACHE_DIR  cache directory (default: ${XDG_CACHE_HOME:-~/.cache}/otelprof)
#   GO                  go command (default: go)
#
# Prints the binary's absolute path as its last line on stdout; progress goes to stderr.
# tests/services.py computes the same path (collector_binary_path) — keep the two in step.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
manifest="${1:-$here/collector-config/builder-config.yaml}"
go_cmd="${GO:-go}"

if [[ ! -f "$manifest" ]]; then
    echo "build-collector: manifest not found: $manifest" >&2
    exit 2
fi
if ! command -v "$go_cmd" >/dev/null 2>&1; then
    echo "build-collector: '$go_cmd' not found; install Go (1.25 or newer) to build the collector" >&2
    exit 2
fi

cache_dir="${OTELPROF_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/otelprof}"
hash="$(sha256sum "$manifest" | cut -c1-12)"
binary="$cache_dir/otelcol-otelprof-$hash"

if [[ -x "$binary" ]]; then
    echo "build-collector: up to date (manifest hash $hash)" >&2
    echo "$binary"
    exit 0
fi

# The builder must match the collector core version the manifest pins.
builder_version="$(sed -nE 's#^.*go\.opentelemetry\.io/collector/receiver/otlpreceiver (v[0-9.]+).*$#\1#p' "$manifest" | head -n1)"
if [[ -z "$builder_version" ]]; then
    echo "build-collector: cannot find the otlpreceiver version in $manifest (it fixes the builder version)" >&2
    exit 2
fi

mkdir -p "$cache_dir"
exec 9>"$cache_dir/.build.lock"
flock 9   # one build at a time; a concurrent caller waits, then finds the binary
if [[ -x "$binary" ]]; then
    echo "$binary"
    exit 0
fi

tools="$cache_dir/tools/builder-$builder_version"
if [[ ! -x "$tools/builder" ]]; then
    echo "build-collector: installing builder $builder_version" >&2
    GOBIN="$tools" CGO_ENABLED=0 "$go_cmd" install -trimpath -ldflags="-s -w" \
        "go.opentelemetry.io/collector/cmd/builder@$builder_version" >&2
fi

work="$cache_dir/build-$hash"
rm -rf "$work"
mkdir -p "$work"
cp "$manifest" "$work/manifest.yaml"
echo "build-collector: building otelcol-otelprof (manifest hash $hash) in $work; this takes minutes" >&2
(
    cd "$work"
    export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -buildvcs=false"
    "$tools/builder" --config manifest.yaml >&2
)
built="$work/_build/otelcol-otelprof"
if [[ ! -x "$built" ]]; then
    echo "build-collector: the builder finished but $built is missing" >&2
    exit 1
fi
mv -f "$built" "$binary.tmp"
mv -f "$binary.tmp" "$binary"
rm -rf "$work"
echo "build-collector: built $binary" >&2
echo "$binary"
